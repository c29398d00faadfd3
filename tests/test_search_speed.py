"""The simulator's speed-ups are exact: the step-shape cache gives the cost model's own breakdown for every
plan of a shape, and whole runs (one instance with Sarathi or vLLM scheduling and prefix sharing, a colocated
cluster, a P/D split) give bit for bit the same summaries, per-request token times, tokens, block tables and
timelines with the fast paths (shape cache, decode runs) on and off (KVBALANCE_SIM_FAST)."""

from __future__ import annotations

import json
import random

import pytest

from kvbalance.batch import BatchPlan, ScheduledSeq
from kvbalance.executor.sim import SimExecutor, step_shape
from kvbalance.perf.cost import CostModel
from kvbalance.request import Request, SamplingParams
from kvbalance.workloads.tokens import unique_prompt


def plan_of(seqs: list[tuple[int, int, bool]]) -> BatchPlan:
    plan = BatchPlan()
    for i, (n, ctx, sample) in enumerate(seqs):
        req = Request(f"q{i}", unique_prompt(i, ctx), SamplingParams(max_tokens=4))
        plan.seqs.append(ScheduledSeq(req, ctx - n, n, sample))
    return plan


@pytest.mark.parametrize("model, gpu, tp", [("llama-2-7b", "a100-80gb", 1), ("llama-2-70b", "h100-sxm", 4)])
def test_plans_of_one_shape_take_the_cost_models_time_to_the_bit(model, gpu, tp):
    rng = random.Random(7)
    cost = CostModel(model, gpu, tp)
    cached = SimExecutor(CostModel(model, gpu, tp), shape_cache=True)
    for _ in range(150):
        decodes = [(1, rng.randint(1, 3000), True) for _ in range(rng.randint(0, 40))]
        chunks = [
            (n, n + rng.randint(0, 2000), rng.random() < 0.5)
            for n in rng.sample(range(2, 600), rng.randint(0, 2))
        ]
        seqs = decodes + chunks
        if not seqs:
            continue
        # the same shape: decodes' contexts moved between them (same sum), reordered among themselves
        shifted = list(decodes)
        if len(shifted) >= 2 and shifted[0][1] > 1:
            shifted[0] = (1, shifted[0][1] - 1, True)
            shifted[1] = (1, shifted[1][1] + 1, True)
        rng.shuffle(shifted)
        for variant in (seqs, shifted + chunks):
            p = plan_of(variant)
            assert step_shape(p) == step_shape(plan_of(seqs))
            assert cached.execute(p).breakdown == cost.predict(p)
    assert cached.shape_hits >= 100


def test_a_cached_breakdown_is_a_copy_callers_can_change():
    ex = SimExecutor(CostModel("llama-2-7b", "a100-80gb"), shape_cache=True)
    first = ex.execute(plan_of([(1, 100, True)] * 4))
    first.breakdown.overhead_s += 1.0  # what the elastic reserve does to a step's breakdown
    again = ex.execute(plan_of([(1, 100, True)] * 4))
    assert (
        ex.shape_hits == 1
        and again.duration_s == pytest.approx(first.duration_s)
        and again.breakdown != first.breakdown
    )


def _run_all(monkeypatch, fast: str) -> list[str]:
    monkeypatch.setenv("KVBALANCE_SIM_FAST", fast)
    monkeypatch.setenv("KVBALANCE_SIM_DECODE_RUNS", fast)
    from kvbalance.cluster.config import run_cluster
    from kvbalance.cluster.systems import pd_config, vllm_config
    from kvbalance.sim.run import SimulateConfig, run_simulation
    from kvbalance.workloads.presets import build_requests

    out = []
    single = SimulateConfig(workload="sharegpt", rate=30.0, num_requests=300, ttft_slo_s=0.5, tpot_slo_s=0.05)
    for cfg in (
        single,
        single.model_copy(update={"policy": "vllm", "workload": "prefix:4:256:10-200:10-300"}),
    ):
        res = run_simulation(cfg, report=False)
        out.append(json.dumps(res.summary, sort_keys=True))
        out.append(json.dumps([(r.first_token_s, r.finish_s, r.token_times_s, r.output_token_ids, r.block_ids)
                               for r in res.requests]))  # fmt: skip
        out.append(
            json.dumps([res.timeline.column(c).tolist() for c in ("time_s", "running", "kv_used_tokens")])
        )
    sim = SimulateConfig(model="llama-2-13b", workload="alpaca", rate=40.0, num_requests=300)
    for ccfg in (vllm_config(3), pd_config(1, 2)):
        reqs = build_requests("alpaca", 300, 40.0, 0, 4096)
        r = run_cluster(sim, ccfg, reqs)
        runs = sum(m.driver.decode_run_steps for m in r.cluster.members)
        assert (runs > 0) == (fast == "1" and r.cluster.pd is None), (fast, runs)  # the path under test ran
        out.append(json.dumps(r.summary, sort_keys=True, default=str))
        out.append(json.dumps([(q.first_token_s, q.finish_s) for q in reqs]))
    return out


def test_runs_are_bit_for_bit_the_same_with_the_fast_paths_on_and_off(monkeypatch):
    on = _run_all(monkeypatch, "1")
    off = _run_all(monkeypatch, "0")
    assert on == off
