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


def summary(result: FitResult) -> dict:
    """JSON-ready errors of a fit (what ``--report`` writes as ``errors.json``)."""
    return {
        "hardware": result.hardware.name,
        "operators": [e.to_dict() for e in result.errors],
        "host": [e.to_dict() for e in result.host_errors],
        "all_reduce": [e.to_dict() for e in result.link_errors],
    }


def write_points(result: FitResult, path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "model",
                "op",
                "profile_op",
                "class",
                "num_tokens",
                "tp",
                "measured_s",
                "predicted_s",
                "rel_error",
            ]
        )
        for s, p in zip(result.samples, result.predicted_s):
            w.writerow([s.shape.model, s.op, s.profile_op, op_class(s), s.num_tokens, s.tp,
                        f"{s.time_s:.9g}", f"{p:.9g}", f"{p / s.time_s - 1:.6f}"])  # fmt: skip


def plot(result: FitResult, out: Path) -> list[Path]:
    """``scatter.png`` (predicted vs measured, log-log, one panel per class) and ``residuals.png`` (relative
    error vs token count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = list(dict.fromkeys(op_class(s) for s in result.samples))
    labels = np.array([op_class(s) for s in result.samples])
    meas = np.array([s.time_s for s in result.samples]) * 1e6
    pred = result.predicted_s * 1e6
    tokens = np.array([s.num_tokens for s in result.samples])
    tp = np.array([s.tp for s in result.samples])
    cols = 4
    rows = -(-len(classes) // cols)
    paths = []
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.6 * rows), squeeze=False)
    for ax, cls in zip(axes.flat, classes):
        sel = labels == cls
        sc = ax.scatter(meas[sel], pred[sel], c=np.log2(tokens[sel]), s=3, cmap="viridis", alpha=0.6)
        lo, hi = min(meas[sel].min(), pred[sel].min()), max(meas[sel].max(), pred[sel].max())
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.plot([lo, hi], [lo * 1.3, hi * 1.3], "k:", lw=0.6)
        ax.plot([lo, hi], [lo / 1.3, hi / 1.3], "k:", lw=0.6)
        ax.set(xscale="log", yscale="log", title=cls, xlabel="measured (us)", ylabel="predicted (us)")
        fig.colorbar(sc, ax=ax, label="log2 tokens")
    for ax in list(axes.flat)[len(classes) :]:
        ax.axis("off")
    fig.suptitle(f"{result.hardware.name}: cost model vs measured operator times (dotted: +-30%)")
    fig.tight_layout()
    paths.append(out / "scatter.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False, sharey=True)
    for ax, cls in zip(axes.flat, classes):
        sel = labels == cls
        ax.scatter(
            tokens[sel], pred[sel] / meas[sel] - 1, c=np.log2(tp[sel]), s=3, cmap="coolwarm", alpha=0.6
        )
        ax.axhline(0, color="k", lw=0.8)
        for y in (-0.1, 0.1):
            ax.axhline(y, color="k", lw=0.5, ls=":")
        ax.set(xscale="log", title=cls, xlabel="tokens (M)", ylabel="pred / meas - 1", ylim=(-1, 1.5))
    for ax in list(axes.flat)[len(classes) :]:
        ax.axis("off")
    fig.suptitle(f"{result.hardware.name}: relative error vs token count (colour: log2 TP; dotted: +-10%)")
    fig.tight_layout()
    paths.append(out / "residuals.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_report(result: FitResult, out: str | Path, plots: bool = True) -> list[Path]:
    """Write ``points.csv``, ``errors.json`` and (``plots``) the two plots under ``out``; returns the files."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    write_points(result, d / "points.csv")
    (d / "errors.json").write_text(json.dumps(summary(result), indent=2) + "\n")
    return [d / "points.csv", d / "errors.json", *(plot(result, d) if plots else [])]
