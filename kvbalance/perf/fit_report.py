"""The fidelity report of a GPU fit: error tables (median and worst relative error per operator class and
token range), every training point predicted vs measured (CSV), and plots (log-log scatter per class, residual
vs token count) so a user sees where the cost model is trusted and where not.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvbalance.perf.fit_gpu import ClassError, FitResult, op_class


def format_errors(title: str, rows: Sequence[ClassError]) -> str:
    """A fixed-width table of ``rows`` (class, range, count, median, worst)."""
    lines = [title, f"  {'class':<20} {'range':<18} {'n':>6} {'median':>8} {'worst':>8}"]
    for e in rows:
        lines.append(f"  {e.op_class:<20} {e.tokens:<18} {e.count:>6} {e.median:>8.1%} {e.worst:>8.1%}")
    return "\n".join(lines)


# The ways a fit's operator errors are scored (perf/fit_cv.py): header, FitResult attribute path.
WAYS = (
    ("(1) phys train", "(1) physical model, training points", "errors"),
    (
        "(2a) LOO point",
        "(2a) corrected, leave-one-point-out along M (the check's figure)",
        "loo_point_errors",
    ),
    ("(2b) LOO model", "(2b) corrected, leave-one-model-out", "loo_model_errors"),
    ("(3) corr train", "(3) corrected, training points", "corrected_errors"),
)


def ways(result: FitResult) -> list[tuple[str, str, list[ClassError]]]:
    """The operator error tables of ``result``: the physical model's, and with corrections the three others."""
    out = [(WAYS[0][0], WAYS[0][1], result.errors)]
    if result.correction is not None:
        out += [(short, title, getattr(result.correction, attr)) for short, title, attr in WAYS[1:]]
    return out


def format_ways(result: FitResult, totals: bool = False) -> str:
    """One row per class and token range, median / worst under every way of scoring (the <30% check reads
    (2a))."""
    tables = ways(result)
    head = "".join(f" {short:>17}" for short, _, _ in tables)
    lines = [
        "operator error |pred/meas - 1|, median / worst:",
        *(f"  {title}" for _, title, _ in tables),
        f"  {'class':<20} {'range':<10} {'n':>6}{head}",
    ]
    for i, e in enumerate(tables[0][2]):
        if totals and e.tokens != "all":
            continue
        cells = "".join(f" {f'{t[i].median:6.1%} / {t[i].worst:6.1%}':>17}" for _, _, t in tables)
        lines.append(f"  {e.op_class:<20} {e.tokens:<10} {e.count:>6}{cells}")
    return "\n".join(lines)


def summary(result: FitResult) -> dict:
    """JSON-ready errors of a fit (what ``--report`` writes as ``errors.json``): ``operators`` is the physical
    model's training error; with corrections, ``corrected`` holds the three other ways and the
    leave-one-point-out points past 30% (``check_failures``)."""
    out = {
        "hardware": result.hardware.name,
        "operators": [e.to_dict() for e in result.errors],
        "host": [e.to_dict() for e in result.host_errors],
        "all_reduce": [e.to_dict() for e in result.link_errors],
    }
    c = result.correction
    if c is not None:
        out["corrected"] = {
            "num_shapes": len(c.corrections),
            **{attr: [e.to_dict() for e in getattr(c, attr)] for _, _, attr in WAYS[1:]},
            "check": "worst leave-one-point-out error per class under 30%",
            "check_failures": c.failures(result.samples),
        }
    return out


def write_points(result: FitResult, path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        c = result.correction
        cols = ["physical_s"] + (["loo_point_s", "loo_model_s", "corrected_s"] if c is not None else [])
        preds = [result.physical_s] + ([c.loo_point_s, c.loo_model_s, c.corrected_s] if c is not None else [])
        w.writerow(["model", "op", "profile_op", "class", "num_tokens", "tp", "measured_s", *cols,
                    "physical_rel_error", *(["loo_point_rel_error"] if c is not None else [])])  # fmt: skip
        for i, s in enumerate(result.samples):
            errs = [f"{p[i] / s.time_s - 1:.6f}" for p in preds[: 2 if c is not None else 1]]
            w.writerow([s.shape.model, s.op, s.profile_op, op_class(s), s.num_tokens, s.tp,
                        f"{s.time_s:.9g}", *(f"{p[i]:.9g}" for p in preds), *errs])  # fmt: skip


def _grid(plt, n: int, height: float, **kw):
    cols = 4
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, height * rows), squeeze=False, **kw)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return fig, axes


def _residuals(plt, result: FitResult, pred: np.ndarray, title: str, path: Path, bound: float | None = None):
    """Relative error vs token count per class (colour: log2 TP); past ``bound``, the points in red."""
    classes = list(dict.fromkeys(op_class(s) for s in result.samples))
    labels = np.array([op_class(s) for s in result.samples])
    meas = np.array([s.time_s for s in result.samples])
    tokens = np.array([s.num_tokens for s in result.samples])
    tp = np.array([s.tp for s in result.samples])
    rel = pred / meas - 1
    fig, axes = _grid(plt, len(classes), 3.2, sharey=True)
    for ax, cls in zip(axes.flat, classes):
        sel = labels == cls
        ax.scatter(tokens[sel], rel[sel], c=np.log2(tp[sel]), s=3, cmap="coolwarm", alpha=0.6)
        if bound is not None:
            bad = sel & (np.abs(rel) > bound)
            ax.scatter(
                tokens[bad], np.clip(rel[bad], -1, 1.5), s=14, facecolors="none", edgecolors="black", lw=0.9
            )
            for y in (-bound, bound):
                ax.axhline(y, color="black", lw=0.6, ls="--")
            ax.set_title(f"{cls} ({int(bad.sum())} past {bound:.0%})")
        else:
            ax.set_title(cls)
        ax.axhline(0, color="k", lw=0.8)
        for y in (-0.1, 0.1):
            ax.axhline(y, color="k", lw=0.5, ls=":")
        ax.set(xscale="log", xlabel="tokens (M)", ylabel="pred / meas - 1", ylim=(-1, 1.5))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(result: FitResult, out: Path) -> list[Path]:
    """``scatter.png`` (the physical model's prediction vs measured, log-log, one panel per class),
    ``residuals.png`` (its relative error vs token count) and, with corrections, ``cv_residuals.png`` (the
    corrected model's leave-one-point-out error vs token count, the points past 30% circled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = list(dict.fromkeys(op_class(s) for s in result.samples))
    labels = np.array([op_class(s) for s in result.samples])
    meas = np.array([s.time_s for s in result.samples]) * 1e6
    pred = result.physical_s * 1e6
    tokens = np.array([s.num_tokens for s in result.samples])
    fig, axes = _grid(plt, len(classes), 3.6)
    for ax, cls in zip(axes.flat, classes):
        sel = labels == cls
        sc = ax.scatter(meas[sel], pred[sel], c=np.log2(tokens[sel]), s=3, cmap="viridis", alpha=0.6)
        lo, hi = min(meas[sel].min(), pred[sel].min()), max(meas[sel].max(), pred[sel].max())
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.plot([lo, hi], [lo * 1.3, hi * 1.3], "k:", lw=0.6)
        ax.plot([lo, hi], [lo / 1.3, hi / 1.3], "k:", lw=0.6)
        ax.set(xscale="log", yscale="log", title=cls, xlabel="measured (us)", ylabel="predicted (us)")
        fig.colorbar(sc, ax=ax, label="log2 tokens")
    fig.suptitle(f"{result.hardware.name}: physical cost model vs measured operator times (dotted: +-30%)")
    fig.tight_layout()
    paths = [out / "scatter.png"]
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    name = result.hardware.name
    paths.append(_residuals(plt, result, result.physical_s,
                            f"{name}: physical model, relative error vs token count (colour: log2 TP; dotted: +-10%)",
                            out / "residuals.png"))  # fmt: skip
    if result.correction is not None:
        paths.append(_residuals(plt, result, result.correction.loo_point_s,
                                f"{name}: corrected model, leave-one-point-out along M (circled: past 30%)",
                                out / "cv_residuals.png", bound=0.30))  # fmt: skip
    return paths


def write_report(result: FitResult, out: str | Path, plots: bool = True) -> list[Path]:
    """Write ``points.csv``, ``errors.json`` and (``plots``) the two plots under ``out``; returns the files."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    write_points(result, d / "points.csv")
    (d / "errors.json").write_text(json.dumps(summary(result), indent=2) + "\n")
    return [d / "points.csv", d / "errors.json", *(plot(result, d) if plots else [])]
