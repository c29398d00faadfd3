"""``kvbalance cost``: the cost model's predicted time of one step (prefill and/or decode batch)."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("cost", help="predicted time of one step on the cost model")
    p.add_argument("--model", required=True)
    p.add_argument("--gpu", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prefill-tokens", type=int, default=0)
    p.add_argument("--decode-batch", type=int, default=0)
    p.add_argument("--context", type=int, default=0)
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from kvbalance.perf.report import step_cost_report

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
