"""Human-facing output of a run: a PNG report, a rich summary table, and plot/CSV helpers for experiments.

Figures are drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas, so nothing here
touches pyplot's global state or the process-wide backend.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbalance.metrics.timeline import Timeline, downsample_indices
from kvbalance.request import Request, RequestState

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from rich.console import Console
    from rich.table import Table

MAX_PLOT_POINTS = 5000


def _new_figure(width_in: float, height_in: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _plot_cdf(ax: Axes, values: Sequence[float], label: str) -> None:
    ax.set_title(f"{label} CDF")
    ax.set_xlabel(f"{label} (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    if not values:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    x = np.sort(np.asarray(values, dtype=np.float64))
    y = np.arange(1, x.size + 1) / x.size
    idx = downsample_indices(x.size, MAX_PLOT_POINTS)
    ax.step(x[idx], y[idx], where="post")
    ax.set_ylim(0, 1.02)


def _no_timeline(ax: Axes, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no timeline", ha="center", va="center", transform=ax.transAxes)


def write_report_png(
    path: str | os.PathLike,
    requests: Iterable[Request],
    timeline: Timeline | None,
    title: str = "",
) -> None:
    """Six panels: TTFT / TPOT / E2E CDFs over completed requests; KV usage, waiting and running
    requests, and cumulative completions over time. Timelines are downsampled for drawing."""
    reqs = list(requests)
    done = [r for r in reqs if r.state is RequestState.FINISHED]
    fig = _new_figure(15, 8)
    axes = fig.subplots(2, 3)
    if title:
        fig.suptitle(title)
    for ax, label, attr in zip(axes[0], ("TTFT", "TPOT", "E2E"), ("ttft_s", "tpot_s", "e2e_s")):
        _plot_cdf(ax, [v for r in done if (v := getattr(r, attr)) is not None], label)

    ax_kv, ax_queue, ax_done = axes[1]
    if timeline is not None and len(timeline) > 0:
        idx = downsample_indices(len(timeline), MAX_PLOT_POINTS)
        t, usage = timeline.kv_usage()
        ax_kv.plot(t[idx], usage[idx] * 100, lw=1, drawstyle="steps-post")
        ax_kv.set_ylim(0, 105)
        ax_queue.plot(t[idx], timeline.column("waiting")[idx], lw=1, drawstyle="steps-post", label="waiting")
        ax_queue.plot(t[idx], timeline.column("running")[idx], lw=1, drawstyle="steps-post", label="running")
        ax_queue.legend()
    else:
        _no_timeline(ax_kv, "")
        _no_timeline(ax_queue, "")
    ax_kv.set_title("KV cache usage")
    ax_kv.set_xlabel("time (s)")
    ax_kv.set_ylabel("used / capacity (%)")
    ax_queue.set_title("requests over time")
    ax_queue.set_xlabel("time (s)")
    ax_queue.set_ylabel("requests")

    finish = np.sort(np.array([r.finish_s for r in done], dtype=np.float64))
    ax_done.set_title("completions")
    ax_done.set_xlabel("time (s)")
    ax_done.set_ylabel("completed requests")
    if finish.size:
        idx = downsample_indices(finish.size, MAX_PLOT_POINTS)
        ax_done.step(finish[idx], idx + 1, where="post")
    for ax in (ax_kv, ax_queue, ax_done):
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)


def plot_lines(
    path: str | os.PathLike,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str = "",
    *,
    logx: bool = False,
    logy: bool = False,
    markers: bool = True,
) -> None:
    """One line per named series of (xs, ys) on shared axes, saved as an image (format from the suffix)."""
    fig = _new_figure(7, 4.5)
    ax = fig.subplots()
    for name, (xs, ys) in series.items():
        if len(xs) != len(ys):
            raise ValueError(f"series: {name!r} has {len(xs)} xs but {len(ys)} ys")
        ax.plot(xs, ys, marker="o" if markers else None, ms=4, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if series:
        ax.legend()
    fig.savefig(path, dpi=100)


def write_table_csv(
    path: str | os.PathLike,
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
) -> None:
    """Write dict rows as CSV. Columns default to the union of keys in first-seen order; None -> empty cell."""
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for row in rows:
            w.writerow(["" if (v := row.get(c)) is None else v for c in columns])


def _fmt(x: Any, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}{unit}"
    return f"{x:,}{unit}"


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:,.1f} ms"


def summary_table(summary: Mapping[str, Any], title: str = "kvbalance summary") -> Table:
    """A two-column rich table of the headline metrics of a ``summarize`` result."""
    from rich.table import Table

    s = summary
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("completed / rejected", f"{_fmt(s.get('completed'))} / {_fmt(s.get('rejected'))}")
    if s.get("unfinished"):
        table.add_row("unfinished", _fmt(s["unfinished"]))
    table.add_row("throughput", _fmt(s.get("throughput_rps"), " req/s"))
    table.add_row("steady throughput", _fmt(s.get("steady_throughput_rps"), " req/s"))
    if s.get("ttft_slo_s") is not None or s.get("tpot_slo_s") is not None:
        table.add_row("goodput", _fmt(s.get("goodput_rps"), " req/s"))
    table.add_row(
        "tokens/s (in / out)",
        f"{_fmt(s.get('input_tokens_per_s'), digits=0)} / {_fmt(s.get('output_tokens_per_s'), digits=0)}",
    )
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        stats = s.get(key) or {}
        table.add_row(f"{label} mean / p99", f"{_fmt_ms(stats.get('mean'))} / {_fmt_ms(stats.get('p99'))}")
    table.add_row("KV capacity", _fmt(s.get("kv_capacity_tokens"), " tokens"))
    usage = s.get("kv_usage_mean")
    table.add_row("KV usage (mean)", "-" if usage is None else f"{usage * 100:.1f}%")
    hit = s.get("prefix_hit_rate")
    table.add_row("prefix hit rate", "-" if hit is None else f"{hit * 100:.1f}%")
    table.add_row("preemptions", _fmt(s.get("preemptions")))
    return table


def print_summary_table(summary: Mapping[str, Any], console: Console | None = None) -> Table:
    """Print ``summary_table(summary)`` to ``console`` (a new rich Console by default) and return it."""
    from rich.console import Console

    table = summary_table(summary)
    (console or Console()).print(table)
    return table
