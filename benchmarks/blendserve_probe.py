"""One BlendServe trace under one planner configuration, with what each tenth of the run did.

Prints the makespan's share of the practical optimum and, per tenth of the makespan, the duration-weighted
compute and memory-bandwidth utilisation, and the mean decodes, prefill tokens, KV tokens held and waiting
requests per step: where a planner leaves one resource idle (docs/reproductions.md, BlendServe). Options are
the planner's constructor arguments as JSON; ``--oracle`` gives the live admission the true output lengths
instead of the estimates (a what-if, for how much the estimates cost).

Run: .venv/bin/python benchmarks/blendserve_probe.py --requests 64000 --trace trace1 \\
         [--planner blendserve] [--options '{"memory_rule": "average", "pace_engine": false}'] [--oracle]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16_000)
    ap.add_argument("--trace", default="trace1")
    ap.add_argument("--planner", default="blendserve")
    ap.add_argument("--options", default="{}", help="the planner's constructor arguments, JSON")
    ap.add_argument("--oracle", action="store_true", help="the live admission sees the true output lengths")
    args = ap.parse_args()

    from kvbalance.engine import Instance
    from kvbalance.offline.admission import DualScanAdmission
    from kvbalance.offline.plan import PLANNERS, PlanContext
    from kvbalance.offline.simulate import OfflineEngineConfig, job_yardsticks, simulate_plan
    from kvbalance.reproduce.blendserve import GPU, MODEL_8B, SEED, Jobs

    reqs, _ = Jobs().get(MODEL_8B, 1, args.trace, args.requests)
    ctx = PlanContext(model=MODEL_8B, gpu=GPU, tp=1, seed=SEED)
    engine = OfflineEngineConfig(record_steps=True)
    t0 = time.process_time()
    plan = PLANNERS.get(args.planner)(**json.loads(args.options)).plan(reqs, ctx)
    if args.oracle:
        if not isinstance(plan.admission, DualScanAdmission):
            raise SystemExit(f"--oracle: planner {args.planner!r} has no live dual-scan admission")
        a = plan.admission
        lens = list(a._args)
        lens[3] = np.array([r.sampling.max_tokens for r in reqs], dtype=np.float64)
        plan.admission = DualScanAdmission(*lens, **a._kw)
    steps: list[tuple[int, int, int, int]] = []
    step = Instance.step

    def recording_step(self, now):
        out = step(self, now)
        if out is not None:
            seqs = out.plan.seqs
            sched = self.scheduler
            steps.append(
                (
                    sum(1 for s in seqs if s.num_new_tokens == 1),
                    sum(s.num_new_tokens for s in seqs if s.num_new_tokens > 1),
                    sched.kv_used_tokens,
                    len(sched.waiting),
                )
            )
        return out

    Instance.step = recording_step
    try:
        res = simulate_plan(reqs, plan, ctx, engine, yardsticks=job_yardsticks(reqs, ctx, engine))
    finally:
        Instance.step = step
    row = res.row()
    print(
        f"{args.planner} {args.options}{' oracle' if args.oracle else ''}: {args.trace}, {args.requests} requests: "
        f"{row['optimal_fraction']:.1%} of the practical optimum ({row['makespan_s']:.0f} s of "
        f"{row['practical_optimum_s']:.0f} s), {row['num_preemptions']} preemptions, {row['num_steps']} steps, "
        f"{time.process_time() - t0:.0f} CPU s"
    )
    ends = res.step_end_s
    dur = np.diff(np.concatenate([[0.0], ends]))
    rec = np.asarray(steps, dtype=np.float64)
    print("tenth  compute  memory  decodes  prefill  kv_tokens  waiting  step_ms")
    for k in range(10):
        m = (ends > ends[-1] * k / 10) & (ends <= ends[-1] * (k + 1) / 10)
        w = dur[m]
        r = rec[m]
        print(
            f"{k:5d}  {(res.compute_util[m] * w).sum() / w.sum():7.2f}  {(res.memory_util[m] * w).sum() / w.sum():6.2f}"
            f"  {r[:, 0].mean():7.0f}  {r[:, 1].mean():7.0f}  {r[:, 2].mean():9.0f}  {r[:, 3].mean():7.0f}"
            f"  {w.mean() * 1e3:7.1f}"
        )


if __name__ == "__main__":
    main()
