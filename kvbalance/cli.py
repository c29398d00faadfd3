"""``kvbalance`` command line: simulate, cost, capacity, reproduce, serve, bench, profile.

Every subcommand turns bad input into one clear line naming the field and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DEFAULT_OUT = "runs/simulate"


def _rate(text: str) -> float:
    if text.lower() in ("inf", "infinity"):
        return math.inf
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"rate: not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rate: must be > 0 or inf, got {text}")
    return value


def _fail(message: str) -> int:
    print(f"kvbalance: error: {message}", file=sys.stderr)
    return 2


# -- simulate ---------------------------------------------------------------------------------------


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="simulate serving a workload on the GPU cost model")
    p.add_argument("config", nargs="?", help="YAML config (keys = SimulateConfig fields); flags override it")
    p.add_argument("--model")
    p.add_argument("--gpu")
    p.add_argument("--tp", type=int)
    p.add_argument("--workload")
    p.add_argument("--rate", type=_rate, help="requests/s, or inf (all at time 0)")
    p.add_argument("--num-requests", type=int)
    p.add_argument("--arrival", choices=["poisson", "gamma", "constant"])
    p.add_argument("--cv", type=float, help="coefficient of variation of gamma arrivals")
    p.add_argument("--policy", choices=["sarathi", "vllm"])
    p.add_argument("--chunk-size", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--kv-tokens", type=int, help="KV capacity in tokens (overrides GPU memory)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--ttft-slo", type=float, dest="ttft_slo_s")
    p.add_argument("--tpot-slo", type=float, dest="tpot_slo_s")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print summary.json instead of a table")


def _load_yaml(path: str) -> dict:
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


def cmd_simulate(args) -> int:
    from pydantic import ValidationError

    from kvbalance.sim.run import SimulateConfig, config_error_message, run_simulation

    data = _load_yaml(args.config) if args.config else {}
    out = args.out or data.pop("out", None) or DEFAULT_OUT
    for key in (
        "model",
        "gpu",
        "tp",
        "workload",
        "rate",
        "num_requests",
        "arrival",
        "cv",
        "policy",
        "chunk_size",
        "max_num_seqs",
        "block_size",
        "kv_tokens",
        "seed",
        "ttft_slo_s",
        "tpot_slo_s",
    ):
        v = getattr(args, key)
        if v is not None:
            data[key] = v
    if args.no_prefix_caching:
        data["enable_prefix_caching"] = False
    if isinstance(data.get("rate"), str):
        data["rate"] = _rate(data["rate"])
    try:
        cfg = SimulateConfig(**data)
    except ValidationError as e:
        return _fail(config_error_message(e))
    result = run_simulation(cfg, out_dir=out, progress=not args.no_progress)
    s = result.summary
    if args.json:
        print(json.dumps(s, indent=2, sort_keys=True))
    else:
        from kvbalance.metrics.report import print_summary_table

        print_summary_table(s)
        print(f"wrote {out}/summary.json, requests.csv, timeline.csv, report.png")
    if s.get("unfinished"):
        return _fail(f"{s['unfinished']} requests neither finished nor were rejected (simulator bug)")
    return 0


# -- cost -------------------------------------------------------------------------------------------


def _add_cost(sub) -> None:
    p = sub.add_parser("cost", help="predicted time of one step on the cost model")
    p.add_argument("--model", required=True)
    p.add_argument("--gpu", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prefill-tokens", type=int, default=0)
    p.add_argument("--decode-batch", type=int, default=0)
    p.add_argument("--context", type=int, default=0)
    p.add_argument("--json", action="store_true")


def cmd_cost(args) -> int:
    from kvbalance.perf.cost import step_cost_report

    if not args.prefill_tokens and not args.decode_batch:
        args.prefill_tokens = 1024
    report = step_cost_report(
        args.model, args.gpu, args.tp, args.prefill_tokens, args.decode_batch, args.context
    )
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        for k in (
            "model",
            "gpu",
            "tp",
            "step_time_s",
            "compute_time_s",
            "memory_time_s",
            "overhead_s",
            "comm_s",
        ):
            if k in report:
                print(f"{k:>16}: {report[k]}")
    return 0


# -- serve / bench ----------------------------------------------------------------------------------


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server over the real engine (extra: server, torch)"
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--kv-tokens", type=int, default=65_536)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)


def cmd_serve(args) -> int:
    from kvbalance.server.app import serve

    serve(
        args.model,
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        kv_cache_tokens=args.kv_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.chunk_size,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.threads,
    )
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="load generator for any OpenAI-compatible server")
    p.add_argument("--base-url", required=True)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=_rate, default=math.inf)
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--out", default=None)


def cmd_bench(args) -> int:
    from kvbalance.bench import run_bench

    summary = run_bench(
        args.base_url,
        num_requests=args.num_requests,
        rate=args.rate,
        workload=args.workload,
        seed=args.seed,
        model=args.model,
        max_context=args.max_context,
        out_dir=args.out,
    )
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


# -- main -------------------------------------------------------------------------------------------

# name -> (add_parser(subparsers), command(args) -> exit code); each module below has register(_EXTRA)
_EXTRA: dict = {}


def _plugins() -> None:
    for mod in ("kvbalance.theory.cli", "kvbalance.reproduce", "kvbalance.profile"):
        try:
            m = __import__(mod, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name == mod:
                continue
            raise
        m.register(_EXTRA)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbalance", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    _add_simulate(sub)
    _add_cost(sub)
    _add_serve(sub)
    _add_bench(sub)
    _plugins()
    for add, _ in _EXTRA.values():
        add(sub)
    return parser


COMMANDS = {"simulate": cmd_simulate, "cost": cmd_cost, "serve": cmd_serve, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["simulate", *(argv or [])])
    handler = COMMANDS.get(args.command) or _EXTRA[args.command][1]
    try:
        return handler(args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        return _fail(str(msg))


if __name__ == "__main__":
    sys.exit(main())
