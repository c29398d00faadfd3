"""Plots of a search: the Pareto front of $/h against goodput, and SLO goodput against offered rate per
deployment (from its probes)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(result, path: str | Path) -> None:
    """Every candidate that reached the target (grey), the front (line), the answer (star)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [c for c in result.candidates if c.meets_target]
    if ok:
        ax.scatter([c.usd_per_hour for c in ok], [c.goodput_rps for c in ok], s=14, color="0.6",
                   label="meets the SLOs at the target")  # fmt: skip
    front = result.front
    if front:
        ax.step([c.usd_per_hour for c in front], [c.goodput_rps for c in front], where="post", color="C0",
                marker="o", label="Pareto front")  # fmt: skip
        for c in front:
            ax.annotate(c.deployment.name, (c.usd_per_hour, c.goodput_rps), fontsize=6, xytext=(3, -8),
                        textcoords="offset points")  # fmt: skip
    if result.best is not None:
        ax.scatter([result.best.usd_per_hour], [result.best.goodput_rps], marker="*", s=160, color="C3",
                   zorder=5, label="cheapest meeting the SLOs")  # fmt: skip
    ax.axhline(result.settings.rate, color="C2", lw=0.8, ls="--", label="target rate")
    ax.set_xlabel("cost, $ per hour")
    ax.set_ylabel("goodput, requests/s at SLO")
    ax.set_title(f"{result.settings.model}, {result.settings.workload}: cost vs goodput")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_goodput_vs_rate(result, path: str | Path, max_lines: int = 12) -> None:
    """rate x attainment per probe, per simulated deployment (filled: a full run; hollow: a stopped probe's
    bound), the front's deployments first."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sims = [c for c in result.candidates if c.probes]
    order = list(result.front) + [c for c in sims if c not in result.front]
    for c in order[:max_lines]:
        ps = sorted(c.probes, key=lambda p: p.rate)
        xs = [p.rate for p in ps]
        ys = [p.rate * p.attainment for p in ps]
        line = ax.plot(xs, ys, lw=0.8, label=c.deployment.name)[0]
        color = line.get_color()
        for p, y in zip(ps, ys):
            ax.scatter([p.rate], [y], s=16, color=color if p.exact else "none", edgecolors=color)
    lim = max((p.rate for c in sims for p in c.probes), default=1.0)
    ax.plot([0, lim], [0, lim], color="0.7", lw=0.6, ls=":")
    ax.plot([0, lim], [0, result.settings.probe.target * lim], color="0.5", lw=0.6, ls="--",
            label=f"{result.settings.probe.target:.0%} attainment")  # fmt: skip
    ax.set_xlabel("offered rate, requests/s")
    ax.set_ylabel("rate x SLO attainment, requests/s")
    ax.set_title("SLO goodput against offered rate")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
