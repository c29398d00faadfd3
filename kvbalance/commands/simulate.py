"""``kvbalance simulate``: serve a workload on the GPU cost model and write a summary, tables and a plot."""

from __future__ import annotations

import json
from pathlib import Path

from kvbalance.commands._config_flags import add_config_flags, config_overrides
from kvbalance.commands._util import fail, parse_rate
from kvbalance.scheduler import POLICIES

DEFAULT_OUT = "runs/simulate"
# what the CLI adds to the flags derived from SimulateConfig: parse functions, a registry's choices, the
# short names the flags had before they were derived
FLAG_EXTRAS = {
    "rate": {"type": parse_rate},
    "policy": {"choices": POLICIES.names()},
    "ttft_slo_s": {"aliases": ["--ttft-slo"]},
    "tpot_slo_s": {"aliases": ["--tpot-slo"]},
}


def add_parser(sub) -> None:
    from kvbalance.sim.config import SimulateConfig

    p = sub.add_parser("simulate", help="simulate serving a workload on the GPU cost model")
    p.add_argument("config", nargs="?", help="YAML config (keys = SimulateConfig fields); flags override it")
    add_config_flags(p, SimulateConfig, extras=FLAG_EXTRAS)
    p.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print summary.json instead of a table")


def load_yaml(path: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"config: no such file {path}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config: {path} is not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config: {path} must hold a mapping of keys to values")
    return data


def run(args) -> int:
    from pydantic import ValidationError

    from kvbalance.sim.config import SimulateConfig, config_error_message
    from kvbalance.sim.run import run_simulation

    data = load_yaml(args.config) if args.config else {}
    out = args.out or data.pop("out", None) or DEFAULT_OUT
    cluster_section = data.pop(
        "cluster", None
    )  # many instances: kvbalance/cluster (sim/ stays single-instance)
    data.update(config_overrides(args, SimulateConfig))
    if isinstance(data.get("rate"), str):
        data["rate"] = parse_rate(data["rate"])
    try:
        cfg = SimulateConfig(**data)
    except ValidationError as e:
        return fail(config_error_message(e))
    if cluster_section is not None:
        return _run_cluster(cfg, cluster_section, out, args)
    result = run_simulation(cfg, out_dir=out, progress=not args.no_progress)
    s = result.summary
    if args.json:
        print(json.dumps(s, indent=2, sort_keys=True))
    else:
        from kvbalance.metrics.report import print_summary_table

        print_summary_table(s)
        print(f"wrote {out}/summary.json, requests.csv, timeline.csv, report.png")
    if s.get("unfinished"):
        return fail(f"{s['unfinished']} requests neither finished nor were rejected (simulator bug)")
    return 0


def _run_cluster(cfg, section, out: str, args) -> int:
    """``cluster:`` section given: build the cluster, serve the workload, print per-instance rows and totals."""
    from pydantic import ValidationError

    from kvbalance.cluster.config import ClusterConfig, run_cluster
    from kvbalance.metrics.summary import write_requests_csv, write_summary_json
    from kvbalance.sim.run import config_error_message
    from kvbalance.workloads.presets import build_requests

    if not isinstance(section, dict):
        return fail("cluster: must be a mapping (instances, router, store, ...)")
    try:
        ccfg = ClusterConfig(**section)
    except ValidationError as e:
        return fail("cluster." + config_error_message(e))
    max_context = cfg.max_context or 1 << 30
    from kvbalance.specs import get_model

    max_context = min(max_context, get_model(cfg.model).max_context)
    reqs = build_requests(cfg.workload, cfg.num_requests, cfg.rate, cfg.seed, max_context, arrival=cfg.arrival,
                          cv=cfg.cv, time_scale=cfg.time_scale)  # fmt: skip
    res = run_cluster(cfg, ccfg, reqs)
    s = {**res.summary, "instances": res.instances}
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    write_summary_json(path / "summary.json", s)
    write_requests_csv(path / "requests.csv", reqs)
    if args.json:
        print(json.dumps(s, indent=2, sort_keys=True, default=str))
    else:
        from rich.console import Console
        from rich.table import Table

        from kvbalance.metrics.report import print_summary_table

        table = Table(
            title=f"{ccfg.describe()} on {res.cluster.topology.num_gpus} x {cfg.gpu}, router {ccfg.router}"
        )
        for col in ("instance", "role", "gpus", "requests", "steps", "busy", "kv usage", "preemptions"):
            table.add_column(col)
        for r in res.instances:
            table.add_row(r["instance"], r["role"], ",".join(map(str, r["gpus"])), str(r["requests"]),
                          str(r["steps"]), f"{r['busy_fraction']:.3f}", f"{r['kv_usage_mean']:.3f}",
                          str(r["preemptions"]))  # fmt: skip
        Console().print(table)
        print_summary_table(res.summary)
        print(f"hot-spot ratio (max/min busy per role): {res.summary['hot_spot_ratio_by_role']}")
        print(f"wrote {out}/summary.json, requests.csv")
    if s.get("unfinished"):
        return fail(f"{s['unfinished']} requests neither finished nor were rejected (simulator bug)")
    return 0
