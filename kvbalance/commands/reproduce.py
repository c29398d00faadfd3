"""``kvbalance reproduce NAME``: run one paper experiment (``kvbalance.reproduce.NAME``) into a folder."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from kvbalance.reproduce import EXPERIMENTS


def add_parser(sub) -> None:
    p = sub.add_parser("reproduce", help="reproduce a paper's headline result")
    p.add_argument(
        "name", choices=sorted(EXPERIMENTS), help="; ".join(f"{k}: {v}" for k, v in EXPERIMENTS.items())
    )
    p.add_argument("--quick", action="store_true", help="smaller run (minutes, not tens of minutes)")
    p.add_argument("--out", default=None, help="output folder (default runs/reproduce-NAME)")
    p.add_argument(
        "--settings",
        default=None,
        help="banaserve: run only these settings, comma-separated (workload names such as docqa-uniform,phases-15, "
        "or keys model/workload/arrival); settings already in --out are kept and reported",
    )
    p.add_argument(
        "--engine",
        default=None,
        help="engine profile for every cost model the experiment builds without one of its own "
        "(default: vllm-v1 on GPU presets)",
    )


def run(args) -> int:
    mod = importlib.import_module(f"kvbalance.reproduce.{args.name}")
    out = Path(args.out or f"runs/reproduce-{args.name}")
    out.mkdir(parents=True, exist_ok=True)
    from kvbalance.perf.engines import default_engine

    kwargs = {}
    if getattr(args, "settings", None):
        if args.name != "banaserve":
            raise SystemExit("--settings: banaserve only")
        kwargs["settings"] = tuple(x.strip() for x in args.settings.split(",") if x.strip())
    with default_engine(args.engine):
        results = mod.run(out, quick=args.quick, **kwargs)
    print(json.dumps(results, indent=2, sort_keys=True, default=str)[:4000])
    print(f"wrote {out}/results.json")
    return 0
