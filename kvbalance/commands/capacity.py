"""``kvbalance capacity``: the queueing-stability check and capacity plan for one model / GPU / workload.

Computes the paper's mu = M / (b E[g(s, o)]) and delta = ess sup(s + o) / M, the verdict for an offered
rate (stable below mu (1 - delta), unstable at or above mu) and the instances needed. M comes from
``--kv-tokens`` or the GPU memory exactly as ``kvbalance simulate`` derives it; E[g] is exact over the
workload's length pmfs; b is measured: a short saturated simulation (``--b-requests`` requests, all at time 0)
of this instance, keeping the steps between the 10th and 90th percentile completion times (warm-up and drain
left out), and taking the paper's estimator (median, or the 10%-trimmed mean when steps are right-skewed).
With an SLO the rate is also simulated, at rate / n on one of the n instances needed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from kvbalance.metrics.summary import to_json_value

B_METHODS = ("auto", "median", "trimmed_mean", "mean")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "capacity", help="queueing-stability check: mu, delta, verdict and instances needed for a rate"
    )
    p.add_argument("--model", required=True)
    p.add_argument("--gpu", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument(
        "--engine", default=None, help="engine profile whose host time the steps pay (default: vllm-v1)"
    )
    p.add_argument("--workload", required=True)
    p.add_argument("--rate", required=True, help="offered arrival rate lambda, requests/s (>= 0, finite)")
    p.add_argument(
        "--kv-tokens", type=int, default=None, help="KV capacity M in tokens (default: GPU memory)"
    )
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk s_hat = per-step token budget")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", choices=["sarathi", "vllm"], default="sarathi")
    p.add_argument("--batch-time", type=float, default=None, help="b in seconds (skips measuring it)")
    p.add_argument("--b-method", choices=B_METHODS, default="auto", help="estimator of b from step times")
    p.add_argument(
        "--b-requests", type=int, default=500, help="requests in the saturated run that measures b"
    )
    p.add_argument("--headroom", type=float, default=0.0, help="safety fraction off mu (1 - delta)")
    p.add_argument("--ttft-slo", type=float, default=None, help="p90 TTFT objective, seconds")
    p.add_argument("--tpot-slo", type=float, default=None, help="p90 TPOT objective, seconds")
    p.add_argument("--slo-requests", type=int, default=500, help="requests in the SLO simulation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for capacity.json")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"rate: not a number: {text!r}") from None
    if not (math.isfinite(rate) and rate >= 0):
        raise ValueError(f"rate: must be a finite number of requests/s >= 0, got {text}")
    return rate


def _check_args(args) -> None:
    for name, value, lo in (
        ("tp", args.tp, 1),
        ("chunk_size", args.chunk_size, 1),
        ("max_num_seqs", args.max_num_seqs, 1),
        ("block_size", args.block_size, 1),
        ("b_requests", args.b_requests, 20),
        ("slo_requests", args.slo_requests, 20),
    ):
        if value < lo:
            raise ValueError(f"{name}: must be >= {lo}, got {value}")
    if args.kv_tokens is not None and args.kv_tokens < 1:
        raise ValueError(f"kv_tokens: must be >= 1, got {args.kv_tokens}")
    for name, value in (
        ("batch_time", args.batch_time),
        ("ttft_slo", args.ttft_slo),
        ("tpot_slo", args.tpot_slo),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: must be a positive number of seconds, got {value}")
    if not 0 <= args.headroom < 1:
        raise ValueError(f"headroom: must lie in [0, 1), got {args.headroom}")


def _config(args, **overrides):
    from pydantic import ValidationError

    from kvbalance.sim.run import SimulateConfig, config_error_message

    fields = dict(
        model=args.model,
        gpu=args.gpu,
        engine=args.engine,
        tp=args.tp,
        workload=args.workload,
        policy=args.policy,
        chunk_size=args.chunk_size,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        kv_tokens=args.kv_tokens,
        seed=args.seed,
        ttft_slo_s=args.ttft_slo,
        tpot_slo_s=args.tpot_slo,
    )
    fields.update(overrides)
    try:
        return SimulateConfig(**fields)
    except ValidationError as e:
        raise ValueError(config_error_message(e)) from None


def _engine_name(cfg) -> str:
    """The engine profile the run's cost model uses (the config's, else the GPU's default)."""
    from kvbalance.perf.engines import resolve_engine
    from kvbalance.specs import get_gpu

    return resolve_engine(cfg.engine, get_gpu(cfg.gpu)).name


def capacity(args) -> dict[str, Any]:
    """Everything ``kvbalance capacity`` reports, as a JSON-ready dict."""
    from kvbalance.theory.measure import throughput_bounds
    from kvbalance.theory.stability import (
        instances_needed,
        stability_margin,
        stability_verdict,
        stable_service_rate,
    )

    rate = _parse_rate(str(args.rate))
    _check_args(args)
    cfg = _config(args, rate=math.inf, num_requests=args.b_requests)
    m, max_context, area = _memory_and_area(args, cfg)
    b, b_method, measured = _batch_time(args, cfg)

    mu = stable_service_rate(m, b, area.expected_area)  # mu = M / (b E[g])
    delta = stability_margin(area.max_total_tokens, m)  # delta = ess sup(s + o) / M
    verdict = stability_verdict(rate, mu, delta)
    n = instances_needed(rate, mu, delta, args.headroom)
    bounds = throughput_bounds(
        area, kv_capacity_tokens=m, batch_time_s=b, chunk_size=args.chunk_size, max_num_seqs=args.max_num_seqs
    )
    report: dict[str, Any] = {
        "model": args.model,
        "gpu": args.gpu,
        "engine": _engine_name(cfg),
        "tp": args.tp,
        "workload": args.workload,
        "policy": args.policy,
        "kv_capacity_tokens": m,
        "kv_tokens_source": "--kv-tokens" if args.kv_tokens is not None else "gpu memory",
        "chunk_size": args.chunk_size,
        "max_num_seqs": args.max_num_seqs,
        "max_context": max_context,
        "expected_area": area.expected_area,
        "mean_input_tokens": area.mean_input_tokens,
        "mean_output_tokens": area.mean_output_tokens,
        "max_total_tokens": area.max_total_tokens,
        "b_s": b,
        "b_method": b_method,
        "mu_rps": mu,
        "delta": delta,
        "stable_bound_rps": mu * (1 - delta),
        "rate_rps": rate,
        "stable": verdict,
        "headroom": args.headroom,
        "instances_needed": n,
        "per_instance_rate_rps": rate / n,
        **bounds,
        "b_measurement": measured,
    }
    if measured is not None:
        # the same planning rule with the simulator's saturation throughput in place of mu
        mu_sim = measured["saturation_throughput_rps"]
        report["instances_needed_measured"] = instances_needed(rate, mu_sim, delta, args.headroom)
    report["warnings"] = _theory_warnings(bounds["binding"], mu, delta, measured)
    if args.ttft_slo is not None or args.tpot_slo is not None:
        report["slo"] = _slo_check(args, rate, n)
    return to_json_value(report)


def _memory_and_area(args, cfg):
    """M, the max context, and the workload's E[g] and ess sup(s + o); the largest request must fit in M."""
    from kvbalance.sim.run import build_sim_instance
    from kvbalance.theory.measure import workload_area

    inst, _ = build_sim_instance(cfg)
    m = inst.kv_capacity_tokens  # whole blocks, as the simulator allocates them
    max_context = inst.max_context
    area = workload_area(args.workload, args.chunk_size, max_context)
    if area.max_total_tokens > m:
        raise ValueError(
            f"kv_tokens: the largest request ({area.max_total_tokens} tokens) does not fit in KV memory "
            f"({m} tokens)"
        )
    return m, max_context, area


def _batch_time(args, cfg) -> tuple[float, str, dict[str, Any] | None]:
    """b: ``--batch-time`` as given, or measured on a saturated run (with what that run measured)."""
    from kvbalance.cluster.replicas import measure_saturation
    from kvbalance.theory.stability import representative_batch_time

    if args.batch_time is not None:
        return args.batch_time, "given", None
    sat = measure_saturation(cfg)
    steps = sat.b
    b, b_method = representative_batch_time(sat.step_times_s, args.b_method)
    measured = {
        "num_requests": sat.num_requests,
        "window_s": list(sat.window_s),
        "window_steps": steps["count"],
        "b_median_s": steps["median"],
        "b_trimmed_mean_s": steps["trimmed_mean"],
        "b_mean_s": steps["mean"],
        "b_p10_s": steps["p10"],
        "b_p90_s": steps["p90"],
        "saturation_throughput_rps": sat.throughput_rps,
        "kv_usage": sat.kv_usage_window,
        "running_median": sat.running_median,
        "preemptions": sat.preemptions,
    }
    return b, b_method, measured


def _theory_warnings(binding: str, mu: float, delta: float, measured: dict[str, Any] | None) -> list[str]:
    """Where the memory-bound mu may overestimate this instance: another ceiling binds first, or the
    simulated saturation throughput falls below mu (1 - delta)."""
    warnings = []
    if binding != "memory":
        warnings.append(f"{binding} binds before KV memory: the memory-bound mu overestimates this instance")
    if measured is not None:
        mu_sim = measured["saturation_throughput_rps"]
        if mu_sim < mu * (1 - delta):
            warnings.append(
                f"simulated saturation ({mu_sim:.4g} rps) is below mu (1 - delta) ({mu * (1 - delta):.4g} rps)"
            )
    return warnings


def _slo_check(args, rate: float, n: int) -> dict[str, Any]:
    """Simulate rate / n on one instance and compare p90 TTFT / TPOT with the objectives."""
    from kvbalance.sim.run import run_simulation

    per = rate / n
    out: dict[str, Any] = {
        "instances": n,
        "per_instance_rate_rps": per,
        "ttft_slo_s": args.ttft_slo,
        "tpot_slo_s": args.tpot_slo,
        "num_requests": args.slo_requests,
    }
    if per <= 0:
        out["note"] = "rate 0: nothing to simulate"
        return out
    cfg = _config(args, rate=per, num_requests=args.slo_requests)
    s = run_simulation(cfg, report=False).summary
    p90_ttft, p90_tpot = s["ttft_s"]["p90"], s["tpot_s"]["p90"]
    ok_ttft = args.ttft_slo is None or (p90_ttft is not None and p90_ttft <= args.ttft_slo)
    ok_tpot = args.tpot_slo is None or p90_tpot is None or p90_tpot <= args.tpot_slo
    out.update(
        {
            "p90_ttft_s": p90_ttft,
            "p90_tpot_s": p90_tpot,
            "slo_attainment": s["slo_attainment"],
            "goodput_rps_per_instance": s["goodput_rps"],
            "goodput_rps": s["goodput_rps"] * n,
            "throughput_rps": s["throughput_rps"] * n,
            "meets_p90_slo": bool(ok_ttft and ok_tpot),
            "completed": s["completed"],
            "rejected": s["rejected"],
        }
    )
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title=f"capacity: {report['model']} on {report['gpu']} x{report['tp']} ({report['engine']}), "
        f"{report['workload']}"
    )
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("meaning")
    rows = [
        ("M", "kv_capacity_tokens", f"KV capacity, tokens ({report['kv_tokens_source']})"),
        ("s_hat", "chunk_size", "prefill chunk / step token budget"),
        ("E[s]", "mean_input_tokens", "mean prompt tokens"),
        ("E[o]", "mean_output_tokens", "mean output tokens"),
        ("E[g]", "expected_area", "E[g(s, o)], token x batch-steps"),
        ("ess sup(s+o)", "max_total_tokens", "largest request, tokens"),
        ("b", "b_s", f"batch time, s ({report['b_method']})"),
        ("mu", "mu_rps", "M / (b E[g]), requests/s"),
        ("delta", "delta", "ess sup(s + o) / M"),
        ("mu(1-delta)", "stable_bound_rps", "guaranteed-stable rate, requests/s"),
        ("lambda", "rate_rps", "offered rate, requests/s"),
        ("stable", "stable", "true: < mu(1-delta); false: >= mu; margin: between"),
        ("instances", "instances_needed", "smallest n with lambda / n < mu(1-delta)(1-headroom)"),
        ("token bound", "token_budget_bound_rps", "s_hat / (b E[s+o-1]), requests/s"),
        ("seq bound", "max_num_seqs_bound_rps", "max_num_seqs / (b E[steps]), requests/s"),
        ("binding", "binding", "smallest ceiling (the theory assumes memory)"),
    ]
    for sym, key, meaning in rows:
        table.add_row(escape(sym), _fmt(report.get(key)), escape(meaning))
    meas = report.get("b_measurement")
    if meas:
        table.add_row("mu_sim", _fmt(meas["saturation_throughput_rps"]), "saturated run's steady throughput")
        table.add_row(
            "instances (sim)", _fmt(report.get("instances_needed_measured")), "same rule with mu_sim"
        )
        table.add_row(
            "b med/trim/mean",
            f"{meas['b_median_s']:.4g}/{meas['b_trimmed_mean_s']:.4g}/{meas['b_mean_s']:.4g}",
            f"step times over {meas['window_steps']} steps",
        )
    slo = report.get("slo")
    if slo and "p90_ttft_s" in slo:
        table.add_row("p90 TTFT", _fmt(slo["p90_ttft_s"]), f"SLO {slo['ttft_slo_s']}")
        table.add_row("p90 TPOT", _fmt(slo["p90_tpot_s"]), f"SLO {slo['tpot_slo_s']}")
        table.add_row(
            "SLO attainment", _fmt(slo["slo_attainment"]), f"at {slo['per_instance_rate_rps']:.4g} rps"
        )
        table.add_row("goodput", _fmt(slo["goodput_rps"]), "requests/s meeting the SLOs, all instances")
        table.add_row("meets p90 SLO", _fmt(slo["meets_p90_slo"]), "")
    Console().print(table)
    for w in report.get("warnings") or []:
        Console().print(f"[yellow]warning:[/yellow] {escape(w)}")


def run(args) -> int:
    report = capacity(args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "capacity.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print_table(report)
        if args.out:
            print(f"wrote {args.out}/capacity.json")
    sys.stdout.flush()
    return 0
