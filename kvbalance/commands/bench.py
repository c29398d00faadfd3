"""``kvbalance bench``: a load generator for any OpenAI-compatible server (summary with simulate's keys)."""

from __future__ import annotations

import json
import math
import os

from kvbalance.commands._util import parse_rate


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="load generator for any OpenAI-compatible server")
    p.add_argument("--base-url", required=True)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=parse_rate, default=math.inf)
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVBALANCE_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $KVBALANCE_API_KEY)",
    )


def run(args) -> int:
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
        api_key=args.api_key,
    )
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0
