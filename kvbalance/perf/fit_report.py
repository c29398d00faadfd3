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

from kvbalance.perf.fit_check import WAYS, FitCheck, fit_check
from kvbalance.perf.fit_check import summary as check_summary
from kvbalance.perf.fit_floor import LOW_QUANTA, low_quanta, resolution_error, timer_quantum_s
from kvbalance.perf.fit_gpu import ClassError, FitResult, op_class


def format_errors(title: str, rows: Sequence[ClassError]) -> str:
    """A fixed-width table of ``rows`` (class, range, count, median, worst)."""
    lines = [title, f"  {'class':<20} {'range':<18} {'n':>6} {'median':>8} {'worst':>8}"]
    for e in rows:
        lines.append(f"  {e.op_class:<20} {e.tokens:<18} {e.count:>6} {e.median:>8.1%} {e.worst:>8.1%}")
    return "\n".join(lines)


def ways(result: FitResult) -> list[tuple[str, str, list[ClassError]]]:
    """The operator error tables of ``result``: the physical model's, and with corrections the three others."""
    out = [(WAYS[0][1], WAYS[0][2], result.errors)]
    if result.correction is not None:
        out += [(short, title, getattr(result.correction, attr)) for _, short, title, attr, _ in WAYS[1:]]
    return out


def format_tables(
    head: str, tables: Sequence[tuple[str, str, list[ClassError]]], totals: bool = False
) -> str:
    """One row per class and token range, median / worst under every table of ``tables`` (their rows in the
    same order)."""
    cols = "".join(f" {short:>17}" for short, _, _ in tables)
    lines = [head, *(f"  {title}" for _, title, _ in tables), f"  {'class':<20} {'range':<10} {'n':>6}{cols}"]
    for i, e in enumerate(tables[0][2]):
        if totals and e.tokens != "all":
            continue
        cells = "".join(f" {f'{t[i].median:6.1%} / {t[i].worst:6.1%}':>17}" for _, _, t in tables)
        lines.append(f"  {e.op_class:<20} {e.tokens:<10} {e.count:>6}{cells}")
    return "\n".join(lines)


def format_ways(result: FitResult, totals: bool = False) -> str:
    """Raw relative errors under every way of scoring (the <30% check has been read on (2a))."""
    return format_tables("operator error |pred/meas - 1|, median / worst:", ways(result), totals)


def format_resolution(check: FitCheck, totals: bool = False) -> str:
    """Resolution-aware errors (perf/fit_floor.py) under every way of scoring."""
    q_us = check.quantum_s * 1e6
    head = f"resolution-aware operator error max(0, |pred - meas| - q/2) / meas (q = {q_us:g} us), median / worst:"
    return format_tables(head, [(s.short, s.title, s.resolution) for s in check.scorings], totals)


def summary(result: FitResult, check: FitCheck | None = None) -> dict:
    """JSON-ready errors of a fit (what ``--report`` writes as ``errors.json``): ``operators`` is the physical
    model's training error; with corrections, ``corrected`` holds the three other ways and the
    leave-one-point-out points past 30% (``check_failures``); then the timer quantum, the ``floor`` per class
    and, per scoring, ``resolution_aware`` errors, ``check`` and ``failures`` (:func:`fit_check.summary`)."""
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
            **{attr: [e.to_dict() for e in getattr(c, attr)] for _, _, _, attr, _ in WAYS[1:]},
            "check": "worst leave-one-point-out error per class under 30%",
            "check_failures": c.failures(result.samples),
        }
    out.update(check_summary(check if check is not None else fit_check(result)))
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
    """Relative error vs token count per class (colour: log2 TP; grey triangles: points measured at <= 5 timer
    quanta); past ``bound``, the points circled (green: past it resolution-aware too)."""
    classes = list(dict.fromkeys(op_class(s) for s in result.samples))
    labels = np.array([op_class(s) for s in result.samples])
    meas = np.array([s.time_s for s in result.samples])
    tokens = np.array([s.num_tokens for s in result.samples])
    tp = np.array([s.tp for s in result.samples])
    q = timer_quantum_s(result.samples)
    low = low_quanta(result.samples, q)
    rel = pred / meas - 1
    fig, axes = _grid(plt, len(classes), 3.2, sharey=True)
    for ax, cls in zip(axes.flat, classes):
        sel = labels == cls
        ax.scatter(tokens[sel & ~low], rel[sel & ~low], c=np.log2(tp[sel & ~low]), s=3, cmap="coolwarm",
                   alpha=0.6, vmin=0, vmax=3)  # fmt: skip
        ax.scatter(tokens[sel & low], rel[sel & low], marker="^", color="0.45", s=5, alpha=0.6,
                   label=f"<= {LOW_QUANTA} quanta ({q * 1e6:g} us)")  # fmt: skip
        if bound is not None:
            bad = sel & (np.abs(rel) > bound)
            bad_q = bad & (resolution_error(pred, meas, q) >= bound)
            for mask, colour in ((bad & ~bad_q, "black"), (bad_q, "limegreen")):
                ax.scatter(tokens[mask], np.clip(rel[mask], -1, 1.5), s=14, facecolors="none",
                           edgecolors=colour, lw=0.9)  # fmt: skip
            for y in (-bound, bound):
                ax.axhline(y, color="black", lw=0.6, ls="--")
            ax.set_title(
                f"{cls}: {int(bad.sum())} > {bound:.0%} ({int(bad_q.sum())} res.-aware)", fontsize=10
            )
        else:
            ax.set_title(cls)
        if (sel & low).any():
            ax.legend(loc="upper right", fontsize=7)
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
                                f"{name}: corrected model, leave-one-point-out along M "
                                "(circled: past 30%; green: resolution-aware too)",
                                out / "cv_residuals.png", bound=0.30))  # fmt: skip
    return paths


def write_report(
    result: FitResult, out: str | Path, plots: bool = True, check: FitCheck | None = None
) -> list[Path]:
    """Write ``points.csv``, ``errors.json`` (with ``check``, the fit's :class:`FitCheck`, computed if not
    given) and (``plots``) the plots under ``out``; returns the files."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    write_points(result, d / "points.csv")
    (d / "errors.json").write_text(json.dumps(summary(result, check), indent=2) + "\n")
    return [d / "points.csv", d / "errors.json", *(plot(result, d) if plots else [])]
