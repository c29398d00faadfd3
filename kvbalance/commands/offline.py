"""``kvbalance offline plan|run INPUT.jsonl``: plan an OpenAI Batch file (BlendServe) and predict or run it.

* ``plan`` prints, per planner, the batches, densities, prefix sharing and the simulated makespan;
* ``run --simulate --model M --gpu G [--tp N] [--planner P] [--data-parallel N]`` predicts makespan and
  throughput on the cost model;
* ``run --output OUT.jsonl`` runs the real engine (``kvbalance.offline.runner``).

Prompts are tokenised for planning and simulation by a deterministic stand-in (one id per word), so equal text
prefixes share tokens; the real engine uses the model's tokenizer. A line that cannot run is reported with its
line number and left out of the plan; the others go on.
"""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("offline", help="plan and run offline batch jobs (OpenAI Batch files)")
    osub = p.add_subparsers(dest="offline_command", required=True)
    for name, help_ in (
        ("plan", "print each planner's batches, densities, sharing, makespan"),
        ("run", "run a job"),
    ):
        q = osub.add_parser(name, help=help_)
        q.add_argument("input", help="OpenAI Batch input file (JSONL)")
        q.add_argument("--model", default=None, help="default: llama-3.1-8b simulated, smollm2-135m real")
        q.add_argument("--gpu", default="a100-80gb")
        q.add_argument("--tp", type=int, default=1)
        q.add_argument("--kv-tokens", type=int, default=None, help="free KV memory per replica (tokens)")
        q.add_argument(
            "--chunk-tokens", type=int, default=2048, help="chunked-prefill budget (multiple of 128)"
        )
        q.add_argument("--max-num-seqs", type=int, default=1024)
        q.add_argument(
            "--default-max-tokens", type=int, default=256, help="output budget when a line has none"
        )
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--json", action="store_true", help="print JSON instead of a table")
        q.add_argument(
            "--no-host-time",
            action="store_true",
            help="simulate GPU time only (no engine host time per step: the BlendServe paper's accounting)",
        )
        q.add_argument(
            "--interference-factor",
            type=float,
            default=None,
            help="overlap mode's slowdown of the busier resource (default 1.10; >= 1)",
        )
    plan_p = osub.choices["plan"]
    plan_p.add_argument("--planner", action="append", default=None, help="planner(s) to show (default: all)")
    plan_p.add_argument("--batches", type=int, default=5, help="batches to print per planner")
    run_p = osub.choices["run"]
    run_p.add_argument("--planner", default="blendserve")
    run_p.add_argument("--simulate", action="store_true", help="predict on the cost model instead of running")
    run_p.add_argument("--data-parallel", type=int, default=1, help="replicas (balanced subtrees, one each)")
    run_p.add_argument("--output", default=None, help="Batch output file (real run)")
    run_p.add_argument(
        "--ray-address", default=None, help="existing Ray cluster for --data-parallel (real run)"
    )
    from kvbalance.offline.runner import add_run_arguments

    add_run_arguments(run_p, positional_input=False)  # the real run's engine flags (torch extra)


def _context(args):
    from kvbalance.offline.plan import PlanContext
    from kvbalance.specs import get_gpu, get_model

    if args.model is None:
        args.model = "llama-3.1-8b"
    get_model(args.model)
    get_gpu(args.gpu)
    if args.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {args.max_num_seqs}")
    return PlanContext(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        kv_capacity_tokens=args.kv_tokens,
        chunk_tokens=args.chunk_tokens,
        seed=args.seed,
    )


def _load(args):
    from kvbalance.workloads.offline import read_openai_batch

    if args.default_max_tokens < 1:
        raise ValueError(f"default_max_tokens: must be >= 1, got {args.default_max_tokens}")
    batch = read_openai_batch(args.input, args.default_max_tokens)
    for ln in batch.errors:
        print(f"kvbalance: skipped {ln.error}", file=sys.stderr)
    reqs = batch.requests
    if not reqs:
        raise ValueError(f"input: no valid request lines in {args.input}")
    return reqs


def _engine(args):
    from kvbalance.offline.simulate import OfflineEngineConfig
    from kvbalance.perf.overlap import DEFAULT_INTERFERENCE_FACTOR

    f = DEFAULT_INTERFERENCE_FACTOR if args.interference_factor is None else args.interference_factor
    return OfflineEngineConfig(
        max_num_seqs=args.max_num_seqs, interference_factor=f, host_time=not args.no_host_time
    )


def _simulate(reqs, planner: str, ctx, args, data_parallel: int = 1) -> dict:
    from kvbalance.offline.plan import PLANNERS
    from kvbalance.offline.simulate import simulate_plan, simulate_ranks

    plan = PLANNERS.get(planner)().plan(reqs, ctx)
    engine = _engine(args)
    if data_parallel > 1:
        row = simulate_ranks(reqs, plan, ctx, engine, data_parallel)
    else:
        row = simulate_plan(reqs, plan, ctx, engine).row()
    return {"plan": plan, "row": row}


def _run_plan(args) -> int:
    from kvbalance.offline.plan import PLANNERS

    ctx = _context(args)
    _engine(args)  # a bad --interference-factor fails before anything is planned
    reqs = _load(args)
    names = args.planner or list(PLANNERS.names())
    out = []
    for name in names:
        res = _simulate(reqs, name, ctx, args)
        plan, row = res["plan"], res["row"]
        batches = plan.batches or [
            plan.order[i : i + 64] for i in range(0, min(len(plan.order), 64 * args.batches), 64)
        ]
        out.append(
            {
                **row,
                "num_batches": len(plan.batches) if plan.batches else None,
                "density": plan.stats.get("density"),
                "dfs_sharing": plan.stats.get("dfs_sharing"),
                "batches": [[reqs[i].request_id for i in b] for b in batches[: args.batches]],
            }
        )
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(f"{len(reqs)} requests, {args.model} on {args.gpu} x{args.tp}")
    print(f"{'planner':<18}{'makespan_s':>12}{'tok/s':>12}{'sharing':>9}{'opt_frac':>9}{'batches':>9}")
    for r in out:
        nb = r["num_batches"] if r["num_batches"] is not None else "-"
        print(
            f"{r['planner']:<18}{r['makespan_s']:>12.3f}{r['throughput_tokens_per_s']:>12.1f}"
            f"{r['sharing_ratio']:>9.3f}{r['optimal_fraction']:>9.3f}{nb!s:>9}"
        )
    for r in out:
        shown = "; ".join(",".join(b[:6]) + (",..." if len(b) > 6 else "") for b in r["batches"])
        print(f"  {r['planner']}: first batches: {shown}")
    return 0


def _run_run(args) -> int:
    if not args.simulate:
        from kvbalance.offline import runner

        if not args.output:
            raise ValueError("output: give --output OUT.jsonl for a real run (or --simulate to predict)")
        return runner.run_command(args)
    if args.data_parallel < 1:
        raise ValueError(f"data_parallel: must be >= 1, got {args.data_parallel}")
    ctx = _context(args)
    _engine(args)
    reqs = _load(args)
    row = _simulate(reqs, args.planner, ctx, args, args.data_parallel)["row"]
    row.update(
        model=args.model, gpu=args.gpu, tp=args.tp, data_parallel=args.data_parallel, num_requests=len(reqs)
    )
    if args.json:
        print(json.dumps(row, indent=2, default=str))
    else:
        print(
            f"{args.planner} on {args.data_parallel} x {args.model} / {args.gpu} x{args.tp}: "
            f"makespan {row['makespan_s']:.3f} s, throughput {row['throughput_tokens_per_s']:.1f} tok/s, "
            f"sharing {row['sharing_ratio']:.3f}, {row['optimal_fraction']:.1%} of the practical optimum"
        )
    return 0


def run(args) -> int:
    return _run_plan(args) if args.offline_command == "plan" else _run_run(args)
