"""README tables and plots of the BanaServe reproduction (``reproduce/banaserve.py`` computes the rows)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvbalance.metrics.report import _new_figure

COLUMNS = ("system", "config", "max_rate_at_slo_rps", "throughput_rps", "total_time_s", "mean_latency_s",
           "p99_latency_s", "hot_spot_ratio", "migrations", "role_flips")  # fmt: skip
SHOWN = ("vllm", "vllm-v0", "distserve", "llumnix", "banaserve-paper", "banaserve", "kvbalance")  # bar plots


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.3g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["model"], r["workload"], r["arrival"]), []).append(r)
    return out


def _ratio(a, b) -> float | None:
    return a / b if a and b else None


def ratios(group: list[dict]) -> dict[str, float | None]:
    """BanaServe (and this project's policy) against the baselines, for one setting's rows."""
    by = {r["system"]: r for r in group if "not_run" not in r}
    b, v, d = by["banaserve"], by["vllm"], by["distserve"]

    def mr(name):
        return by[name]["max_rate_at_slo_rps"] if name in by else None

    out = {
        "throughput_vs_vllm": _ratio(b["throughput_rps"], v["throughput_rps"]),
        "throughput_vs_distserve": _ratio(b["throughput_rps"], d["throughput_rps"]),
        "max_rate_vs_vllm": _ratio(mr("banaserve"), mr("vllm")),
        "max_rate_vs_distserve": _ratio(mr("banaserve"), mr("distserve")),
        "max_rate_vs_vllm_v0": _ratio(mr("banaserve"), mr("vllm-v0")),
        "total_time_reduction_vs_vllm": 1 - b["total_time_s"] / v["total_time_s"],
        "latency_reduction_vs_distserve": 1 - b["mean_latency_s"] / d["mean_latency_s"],
        "store_share_max_rate": _ratio(mr("banaserve"), mr("banaserve-no-store")),
        "load_aware_vs_cache_aware_max_rate": _ratio(
            mr("banaserve-no-migration"), mr("banaserve-cache-aware")
        ),
        "migration_share_max_rate": _ratio(mr("banaserve"), mr("banaserve-no-migration")),
        "migration_share_throughput": _ratio(
            b["throughput_rps"], by["banaserve-no-migration"]["throughput_rps"]
        )
        if "banaserve-no-migration" in by
        else None,
        "paper_migration_share_max_rate": _ratio(mr("banaserve-paper"), mr("banaserve-no-migration")),
        "role_flip_share_max_rate": _ratio(mr("banaserve"), mr("banaserve-paper")),
        "kvbalance_vs_vllm_max_rate": _ratio(mr("kvbalance"), mr("vllm")),
        "kvbalance_vs_banaserve_max_rate": _ratio(mr("kvbalance"), mr("banaserve")),
    }
    if "llumnix" in by:
        out["throughput_vs_llumnix"] = _ratio(b["throughput_rps"], by["llumnix"]["throughput_rps"])
        out["max_rate_vs_llumnix"] = _ratio(mr("banaserve"), mr("llumnix"))
    return out


HIT_KEYS = ("prefix_hit_rate", "store_hit_rate", "decode_local_hit_rate")


def checks(group: list[dict], note: dict) -> dict[str, Any]:
    """Issue 24's checks on one setting: (a) ``kvbalance`` over vLLM's best router (>= 1.2 on the reuse
    workloads ``docqa-*``, >= 1 elsewhere); (b) on phase-shifting loads, ``banaserve`` per phase over the best
    static split of that phase (>= 1 each) and over the run against the best single static split (DistServe's
    search: >= 1.2); (c) every hit ratio within [0, 1]."""
    by = {r["system"]: r for r in group if "not_run" not in r}
    wl = group[0]["workload"]

    def mr(name):
        return by[name]["max_rate_at_slo_rps"] if name in by else None

    need = 1.2 if wl.startswith("docqa") else 1.0
    a = _ratio(mr("kvbalance"), mr("vllm"))
    out: dict[str, Any] = {"a_kvbalance_vs_vllm": a, "a_needed": need, "a_met": a is not None and a >= need}
    if note.get("best_static_per_phase") and "banaserve" in by:
        per = by["banaserve"].get("per_phase_max_rate_rps") or []
        phase = [_ratio(x, b) for x, b in zip(per, note["best_static_per_phase"])]
        run = _ratio(mr("banaserve"), mr("distserve"))
        out.update({"b_banaserve_vs_best_static_per_phase": phase, "b_banaserve_vs_best_static_run": run,
                    "b_met": bool(phase) and all(x is not None and x >= 1 for x in phase)
                    and run is not None and run >= 1.2})  # fmt: skip
    hits = [r[k] for r in by.values() for k in HIT_KEYS if r.get(k) is not None]
    out["c_met"] = all(0 <= h <= 1 for h in hits)
    return out


def decision_counts(trace: dict | None) -> dict[str, int]:
    """How often the controller took each decision or skipped for each reason (numbers stripped)."""
    import re

    out: dict[str, int] = {}
    for action, reason in zip((trace or {}).get("action", []), (trace or {}).get("reason", [])):
        key = (
            action if action != "none" else re.sub(r"\s*\(.*?\)|[-0-9.]+( -> [-0-9.]+)?", "", reason).strip()
        )
        key = key.rstrip(": ")
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _method(meta: dict) -> str:
    sizes = meta.get("sizes") or {}
    return (
        f"Max-rate search: bracket, then geometric bisection until the bracket is within "
        f"{sizes.get('resolution', 0) * 100:g}% (the threshold lies in [rate, rate x (1 + resolution)], so "
        "systems within that of each other tie); a probe stops as soon as its verdict is certain (90% met, or "
        "more than 10% missed: exact), and `slo_attainment.png` shows such probes' bounds (near 0.9), full runs' "
        "values elsewhere. Every system sees the same requests at a rate. Engine profile of the cost model: "
        f"`{meta.get('engine', '?')}` (vllm-v0 systems: `vllm-v0`, set per system). `banaserve` is BanaServe's "
        "adaptive layer-/attention-level migration plus this project's role flips (`cluster/role_flip.py`); "
        "`banaserve-paper` the published algorithm alone (`cluster/adaptive.py` defaults); `kvbalance` this "
        "project's policy (colocated + global store + `store_aware` routing)."
    )


def write_readme(out: Path, rows: list[dict], meta: dict) -> None:
    lines = [
        f"# BanaServe reproduction (simulated, {meta['num_gpus']} x {meta['gpu']})",
        "",
        f"Run: `kvbalance reproduce banaserve{' --quick' if meta['quick'] else ''}`; wall {meta['wall_s']:.0f} s "
        f"(CPU {meta.get('cpu_s', 0):.0f} s; load average {meta.get('load_average', '?')} on this machine), "
        f"{meta['simulated_runs']} simulated cluster runs, seed {meta['seed']}.",
        "",
        "`max_rate_at_slo_rps`: highest rate at which 90% of requests meet both SLOs. `throughput_rps` / "
        "`total_time_s`: one request set at twice the best max rate (same for all systems). Latencies: end-to-end "
        "at vLLM's max rate at SLO (same load for all). `role_flips`: at that load.",
        "",
        _method(meta),
        "",
        "Paper ranges: " + ", ".join(f"{k} {v}" for k, v in meta["paper"].items()) + ".",
        "",
    ]
    for (model, workload, arrival), group in _groups(rows).items():
        note = meta["settings"][f"{model}/{workload}/{arrival}"]
        lines += [f"## {model}, {workload}, {arrival} ({note.get('group', '?')}: `{note.get('workload_string', '')}`)",
                  "", f"SLOs: TTFT {note['slo_ttft_s']} s, TPOT {note['slo_tpot_s']} s. DistServe split (prefill, "
                  f"decode, TP_p, TP_d): {tuple(note['split'])}; max rate at SLO of each vLLM router, today's: "
                  + ", ".join(f"{k} {_fmt(x)}" for k, x in note.get("vllm_routers", {}).items())
                  + "; 2024's (no chunked prefill): "
                  + ", ".join(f"{k} {_fmt(x)}" for k, x in note.get("vllm-v0_routers", {}).items())
                  + " (- = pruned: misses the SLO at the best rate found)."
                  + (f" Measured at: {note['code']}." if note.get("code") else ""), ""]  # fmt: skip
        if note.get("router_hot_spot"):
            lines += ["Hot-spot ratio per router at vLLM's max rate: "
                      + ", ".join(f"{k} {_fmt(x)}" for k, x in note["router_hot_spot"].items()) + ".", ""]  # fmt: skip
        lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for r in group:
            if "not_run" in r:
                lines.append(f"| {r['system']} | not run: {r['not_run']} |" + " |" * (len(COLUMNS) - 2))
            else:
                lines.append("| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |")
        rat = ratios(group)
        lines += ["", "Ratios: " + ", ".join(f"{k} {_fmt(v)}" for k, v in rat.items()), ""]
        lines += [
            "Checks (issue 24): " + ", ".join(f"{k} {_fmt(v)}" for k, v in checks(group, note).items()),
            "",
        ]
        for r in group:
            if r.get("controller_trace"):
                counts = decision_counts(r["controller_trace"])
                lines += [f"Controller of `{r['system']}` at vLLM's max rate, per 0.5 s tick: "
                          + ", ".join(f"{k}: {v}" for k, v in counts.items()) + ".", ""]  # fmt: skip
        for name, again in note.items():
            # a system measured again at a later commit (``<system>_remeasured``)
            if name.endswith("_remeasured") and isinstance(again, dict):
                lines += [f"`{name.removesuffix('_remeasured')}` measured again at {again.get('code', '?')}: max rate "
                          f"at SLO {_fmt(again.get('max_rate_at_slo_rps'))} req/s ({again.get('what', '')}).", ""]  # fmt: skip
        if note.get("per_phase"):
            lines += ["Max rate at SLO over each phase's requests alone (prefill-heavy, decode-heavy): "
                      + "; ".join(f"{k} {_fmt(v)}" for k, v in note["per_phase"].items())
                      + f". Best static split per phase: {_fmt(note['best_static_per_phase'])}.", ""]  # fmt: skip
    lines += [
        "Plots: `max_rate.png` (max rate at SLO per system and setting, over today's vLLM), `curves.png` (goodput "
        "against the rate), `utilization.png` and `controller.png` (per-instance busy fraction over time and the "
        "adaptive controller's signals and decisions on a phase-shifting load), `hot_spot.png` (hot-spot ratio "
        "per router), `slo_attainment.png` (the search's probes), `migrations.png` (moves and flips in time).",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def _phase_setting(groups: dict) -> tuple | None:
    keys = [k for k in groups if k[1].startswith("phases")]
    return keys[0] if keys else (next(iter(groups)) if groups else None)


def write_plots(out: Path, rows: list[dict], meta: dict | None = None) -> None:
    meta = meta or {"settings": {}}
    groups = _groups([r for r in rows if "not_run" not in r])
    if not groups:
        return
    _plot_max_rates(out, groups)
    _plot_curves(out, groups, meta)
    _plot_slo(out, groups)
    key = _phase_setting(groups)
    _plot_utilization(out, groups[key], key)
    _plot_controller(out, groups[key], key)
    _plot_hot_spots(out, groups, meta)
    _plot_moves(out, groups[key])


def _grid(n: int, w: float, h: float):
    cols = min(n, 4)
    fig = _new_figure(w * cols, h * math.ceil(n / cols))
    return fig, fig.subplots(math.ceil(n / cols), cols, squeeze=False).ravel()


def _plot_max_rates(out: Path, groups: dict) -> None:
    fig, axes = _grid(len(groups), 4.2, 3.0)
    for ax, ((model, wl, arr), group) in zip(axes, groups.items()):
        by = {r["system"]: r for r in group}
        base = by["vllm"]["max_rate_at_slo_rps"] or 1.0
        names = [s for s in SHOWN if s in by]
        vals = [(by[s]["max_rate_at_slo_rps"] or 0.0) / base for s in names]
        ax.bar(range(len(names)), vals, color=[f"C{i}" for i in range(len(names))])
        ax.axhline(1.0, color="k", lw=0.5, ls="--")
        ax.set_xticks(range(len(names)), names, rotation=60, fontsize=6)
        ax.set(title=f"{model} {wl} {arr}", ylabel="max rate at SLO / vLLM's")
        for i, x in enumerate(vals):
            ax.text(i, x, f"{x:.2f}", ha="center", va="bottom", fontsize=6)
    fig.savefig(out / "max_rate.png", dpi=90)


def _plot_curves(out: Path, groups: dict, meta: dict) -> None:
    fig, axes = _grid(len(groups), 4.2, 3.0)
    for ax, (key, _) in zip(axes, groups.items()):
        curves = meta["settings"].get("/".join(key), {}).get("curves", {})
        for name, pts in curves.items():
            ax.plot(
                [p["rate_rps"] for p in pts], [p["goodput_rps"] for p in pts], marker="o", ms=3, label=name
            )
        ax.set(title=" ".join(key), xlabel="rate (req/s)", ylabel="goodput (req/s)")
        ax.legend(fontsize=6)
    fig.savefig(out / "curves.png", dpi=90)


def _plot_slo(out: Path, groups: dict) -> None:
    fig, axes = _grid(len(groups), 5.0, 3.5)
    for ax, ((model, wl, arr), group) in zip(axes, groups.items()):
        for i, r in enumerate(r for r in group if r.get("slo_probes") and r["system"] in SHOWN):
            probes = sorted(r["slo_probes"])
            exact = [(x, y) for x, y, *e in probes if not e or e[0]]
            line = ax.plot(*zip(*exact), marker="o", ms=3, label=r["system"]) if exact else None
            color = line[0].get_color() if line else f"C{i}"
            label = None if line else r["system"]
            for x, y, *e in probes:  # a stopped probe: its bound, ^ (met by at least) / v (at most)
                if e and not e[0]:
                    ax.plot([x], [y], ls="", marker="^" if y >= 0.9 else "v", ms=4, mfc="none", color=color,
                            label=label)  # fmt: skip
                    label = None
        ax.axhline(0.9, color="k", lw=0.5, ls="--")
        ax.set(title=f"{model} {wl} {arr}", xlabel="rate (req/s)", ylabel="SLO attainment", xscale="log")
        ax.legend(fontsize=6)
    fig.savefig(out / "slo_attainment.png", dpi=90)


def _plot_utilization(out: Path, group: list[dict], key: tuple) -> None:
    """The paper's balance figure: each instance's busy fraction over time, role flips marked."""
    runs = [r for r in group if r.get("busy_series") and r["system"] in SHOWN]
    fig = _new_figure(12, 2.2 * len(runs))
    axes = fig.subplots(len(runs), 1, squeeze=False).ravel()
    for ax, r in zip(axes, runs):
        for name, (t, f) in r["busy_series"].items():
            ax.plot(t, f, lw=0.8, label=name)
        for flip in r.get("role_log") or []:
            ax.axvline(flip["t_s"], color="C3" if flip["to"] == "prefill" else "C0", lw=0.6, ls=":")
        ax.set(title=f"{' '.join(key)}: {r['system']} ({r['config']}) at {r['load_rate_rps']:.3g} req/s",
               ylabel="busy", ylim=(0, 1.05))  # fmt: skip
        ax.legend(fontsize=5, ncol=8)
    axes[-1].set_xlabel("time (s); dotted: role flips (red: to prefill, blue: to decode)")
    fig.savefig(out / "utilization.png", dpi=80)


def _plot_controller(out: Path, group: list[dict], key: tuple) -> None:
    """The adaptive controller's view: per-GPU utilisation, imbalance, per-role signals and each decision."""
    runs = [r for r in group if r.get("controller_trace")]
    fig = _new_figure(12, 3.0 * max(1, len(runs)))
    axes = fig.subplots(max(1, len(runs)), 1, squeeze=False).ravel()
    for ax, r in zip(axes, runs):
        tr = r["controller_trace"]
        t = tr["t_s"]
        for i in range(len(tr["instances"])):
            ax.plot(t, [u[i] for u in tr["util"]], lw=0.5, alpha=0.5, color="0.6")
        if any(x is not None for x in tr["imbalance"]):
            ax.plot(t, [x if x is not None else math.nan for x in tr["imbalance"]], lw=1, color="k",
                    label="imbalance (max - min U)")  # fmt: skip
        for name, color in (("prefill_util", "C3"), ("decode_util", "C0")):
            if any(x is not None for x in tr[name]):
                ax.plot(
                    t, [x if x is not None else math.nan for x in tr[name]], lw=1.2, color=color, label=name
                )
        acted = {a for a in tr["action"] if a != "none"}
        for a, m in zip(sorted(acted), "v^sD"):
            xs = [x for x, act in zip(t, tr["action"]) if act == a]
            ax.plot(xs, [0.02] * len(xs), ls="", marker=m, ms=5, label=f"decision: {a}")
        ax2 = ax.twinx()
        if any(x is not None for x in tr["num_prefill"]):
            ax2.step(
                t,
                [x if x is not None else math.nan for x in tr["num_prefill"]],
                where="post",
                color="C2",
                lw=1,
            )
            ax2.set_ylabel("prefill instances", color="C2")
        ax.set(title=f"{' '.join(key)}: {r['system']} controller (grey: each GPU's U)", ylabel="utilisation")
        ax.legend(fontsize=6, ncol=4, loc="upper left")
    axes[-1].set_xlabel("time (s)")
    fig.savefig(out / "controller.png", dpi=80)


def _plot_hot_spots(out: Path, groups: dict, meta: dict) -> None:
    keys = [k for k in groups if meta["settings"].get("/".join(k), {}).get("router_hot_spot")]
    fig = _new_figure(max(6, 1.2 * len(keys)), 3.2)
    ax = fig.subplots()
    routers = sorted({r for k in keys for r in meta["settings"]["/".join(k)]["router_hot_spot"]})
    width = 0.8 / max(1, len(routers))
    for j, router in enumerate(routers):
        vals = [meta["settings"]["/".join(k)]["router_hot_spot"].get(router) or 0 for k in keys]
        ax.bar([i + j * width for i in range(len(keys))], [min(v, 5) for v in vals], width, label=router)
    ax.axhline(1.0, color="k", lw=0.5, ls="--")
    ax.set_xticks(
        [i + 0.4 for i in range(len(keys))], ["/".join(k[1:]) for k in keys], rotation=45, fontsize=6
    )
    ax.set(ylabel="hot-spot ratio (max / min busy)", title="hot-spot ratio per router at vLLM's max rate")
    ax.legend(fontsize=6)
    fig.savefig(out / "hot_spot.png", dpi=90)


def _plot_moves(out: Path, group: list[dict]) -> None:
    fig = _new_figure(8, 2.5)
    ax = fig.subplots()
    moves = [(r["system"], m) for r in group for m in r.get("migration_log_at_load") or []]
    flips = [(r["system"], f) for r in group for f in r.get("role_log") or []]
    names = sorted({name for name, _ in moves + flips})
    for name, m in moves:
        y = names.index(name)
        ax.plot([m["start_s"], m["finish_s"]], [y, y], lw=6, color="C0" if m["kind"] == "layer" else "C1")
    for name, f in flips:
        ax.plot([f["t_s"]], [names.index(name)], ls="", marker="|", ms=10, color="C3")
    if not names:
        ax.text(0.5, 0.5, "no migrations in these runs", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="time (s)", yticks=range(len(names)), yticklabels=names,
           title="at vLLM's max rate: layer moves (blue), attention moves (orange), role flips (red)")  # fmt: skip
    fig.savefig(out / "migrations.png", dpi=80)
