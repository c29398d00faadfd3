"""The decode cohort (scheduler/cohort.py), cohort runs (Instance.cohort_run), cohort-only steps begun without
a plan (Instance.cohort_run_begin), steps of the cohort plus one prompt chunk (Instance.step's fast path) and members running ahead of the clock (InstanceDriver.ahead) are exact: runs with
them (KVBALANCE_SIM_FAST=1, decode runs off) give bit for bit the same summaries, per-request tokens, token
times, block tables, step times and timelines as the step-by-step path (KVBALANCE_SIM_FAST=0): single instances
under Sarathi and vLLM scheduling, with prefix-cache hits, preemptions, requests only a stop token or logprobs
can end, a colocated cluster behind round robin and behind least-loaded routing (members running past arrivals that
go to others), each with a client abort and an outside preemption mid-run."""

from __future__ import annotations

import json
import random

import pytest

from kvbalance.executor.sim import standin_token
from kvbalance.perf.cost import CostModel, breakdown_total_s
from kvbalance.request import Request, SamplingParams
from kvbalance.workloads.tokens import unique_prompt


@pytest.mark.parametrize(
    "model, gpu, tp, engine",
    [("llama-2-70b", "a100-80gb", 4, None), ("llama-2-7b", "a100-80gb", 1, "vllm-v0"),
     ("llama-2-13b", "h100-sxm", 2, "sglang"), ("llama-2-7b", "h100-sxm", 1, "hardware")],
)  # fmt: skip
def test_decode_step_fn_is_the_cost_models_decode_step_to_the_bit(model, gpu, tp, engine):
    cost = CostModel(model, gpu, tp, engine=engine) if engine else CostModel(model, gpu, tp)
    rng = random.Random(3)
    for n in (1, 2, 7, 64, 128, 300):
        fn = cost.decode_step_fn(n)
        for ctx in [n, n + 1, *rng.sample(range(n, 900_000), 60)]:
            assert fn(ctx) == breakdown_total_s(cost.decode_step(n, ctx)), (n, ctx)


def _rows(reqs) -> str:
    return json.dumps([(r.request_id, r.state.value, r.first_scheduled_s, r.first_token_s, r.finish_s,
                        r.finish_reason, r.token_times_s, r.output_token_ids, r.block_ids, r.num_preemptions,
                        r.prefix_hit_tokens, r.num_computed_tokens) for r in reqs])  # fmt: skip


def _kv_state(inst) -> list:
    """The block pool's free list (its order decides later block ids) and the prefix cache's nodes with their
    last-access ticks (the LRU order of eviction)."""
    cache = inst.cache
    if (
        cache is not None and cache.hasher is not None
    ):  # lazy hashes: computed now, they must be the eager ones
        for n in cache.iter_nodes():
            cache.materialize(n)
    nodes = (
        []
        if cache is None
        else [(n.last_access, n.lock_ref, n.block_ids, n.hashes) for n in cache.iter_nodes()]
    )
    return [inst.pool._free, nodes, cache.num_evicted if cache is not None else 0]


def _mixed_requests(n: int) -> list[Request]:
    """Mostly plain decodes, some that a stop token, an EOS or logprobs keep out of the cohort."""
    rng = random.Random(11)
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(20.0)
        kind = i % 7
        sp = SamplingParams(max_tokens=rng.randint(1, 300), ignore_eos=kind != 3)
        if kind == 5:
            sp.stop_token_ids = [7]  # never sampled (stand-in tokens): ends by length, outside the cohort
        if kind == 6:
            sp.logprobs = 2
        out.append(Request(f"m{i}", unique_prompt(i, rng.randint(1, 1500)), sp, arrival_s=t,
                           eos_token_id=2 if kind == 3 else None))  # fmt: skip
    # a prompt that continues another request's output (its stand-in tokens) while that one still decodes:
    # the lookup reaches blocks the cohort fills, whose publication may be deferred
    first = Request("talker", list(range(1000, 1100)), SamplingParams(max_tokens=400, ignore_eos=True))
    said = [standin_token("talker", 100 + i) for i in range(150)]
    reply = Request("reply", [*range(1000, 1100), *said, 5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True),
                    arrival_s=4.0)  # fmt: skip
    return [first, *out, reply]


def _single_runs() -> list[str]:
    from kvbalance.sim.run import SimulateConfig, run_simulation

    out = []
    base = SimulateConfig(workload="sharegpt", rate=30.0, num_requests=300)
    cfgs = [
        base,
        base.model_copy(update={"policy": "vllm", "workload": "prefix:4:256:10-200:10-300"}),
        base.model_copy(update={"workload": "prefix:8:512:10-400:50-400", "rate": 60.0}),
        base.model_copy(update={"kv_tokens": 6000, "rate": 40.0, "num_requests": 200}),  # preemptions
        base.model_copy(update={"chunk_size": 64, "max_num_seqs": 24, "num_requests": 150}),
    ]
    for i, cfg in enumerate(cfgs):
        res = run_simulation(cfg, report=False)
        assert (res.summary["prefix_hit_tokens"] > 0) == (i in (1, 2, 3))  # shared prefixes, recomputes
        assert (res.summary["preemptions"] > 0) == (i == 3)
        out += [json.dumps(res.summary, sort_keys=True, default=str), _rows(res.requests),
                json.dumps([res.timeline.column(c).tolist() for c in res.timeline.columns])]  # fmt: skip
        out.append(json.dumps([res.instance.num_steps, res.instance.busy_s, _kv_state(res.instance)]))
    res = run_simulation(base, report=False, requests=_mixed_requests(250))
    assert (
        res.requests[-1].request_id == "reply" and res.requests[-1].prefix_hit_tokens > 116
    )  # into its decode blocks
    out += [json.dumps(res.summary, sort_keys=True, default=str), _rows(res.requests)]
    return out


def _cluster_runs(steps: dict) -> list[str]:
    from kvbalance.cluster.config import ClusterConfig, InstanceGroup, build_cluster
    from kvbalance.sim.run import SimulateConfig
    from kvbalance.workloads.presets import build_requests

    out = []
    sim = SimulateConfig(model="llama-2-13b", workload="sharegpt", rate=40.0, num_requests=300)
    for router in ("round_robin", "least_loaded"):
        ccfg = ClusterConfig(instances=[InstanceGroup(role="colocated", count=3)], router=router)
        cluster = build_cluster(sim, ccfg)
        reqs = build_requests("sharegpt", 300, 40.0, 0, 4096)
        cluster.loop.at(3.0, cluster.abort, reqs[40])  # a client abort, mid-run
        cluster.loop.at(4.5, _preempt_if_running, cluster, reqs[70])  # a preemption from outside
        run = cluster.run(reqs)
        # least_loaded: the arrivals members ran past (cluster/route_ahead.py)
        if cluster.route_ahead is not None:
            steps["passes"] += cluster.route_ahead.passes
        out += [_rows(reqs), json.dumps([(m.step_starts_s, m.step_durations_s, m.instance.num_steps,
                                          m.instance.load().num_preemptions, _kv_state(m.instance))
                                         for m in run.members])]  # fmt: skip
        out.append(json.dumps([[t.column(c).tolist() for c in t.columns] for t in run.timelines]))
        out.append(json.dumps(run.assignment, sort_keys=True))
    return out


def _preempt_if_running(cluster, req) -> None:
    for m in cluster.members:
        if req in m.instance.scheduler.running:
            m.instance.scheduler.preempt(req)


def _runs(monkeypatch, fast: str) -> tuple[list[str], int, int, int, int]:
    monkeypatch.setenv("KVBALANCE_SIM_FAST", fast)
    monkeypatch.setenv("KVBALANCE_SIM_DECODE_RUNS", "0")
    import kvbalance.engine as engine

    steps = {"cohort": 0, "crossing": 0, "chunk": 0, "passes": 0}
    real_step = engine.Instance.step
    real_begin = engine.Instance.cohort_run_begin

    def counting_begin(self, *a, **k):
        before = self.cohort_run_steps
        t, outcome = real_begin(self, *a, **k)
        steps["cohort"] += self.cohort_run_steps - before - (outcome is not None)
        steps["crossing"] += outcome is not None
        return t, outcome

    def counting_step(self, *a, **k):
        before = self.cohort_chunk_steps
        outcome = real_step(self, *a, **k)
        steps["chunk"] += self.cohort_chunk_steps - before
        return outcome

    monkeypatch.setattr(engine.Instance, "cohort_run_begin", counting_begin)
    monkeypatch.setattr(engine.Instance, "step", counting_step)
    out = _single_runs() + _cluster_runs(steps)
    return out, steps["cohort"], steps["crossing"], steps["chunk"], steps["passes"]


def test_the_decode_cohort_gives_the_step_by_step_results_bit_for_bit(monkeypatch):
    on, cohort_steps, crossing, chunk, passes = _runs(monkeypatch, "1")
    off, off_steps, off_crossing, off_chunk, off_passes = _runs(monkeypatch, "0")
    assert cohort_steps > 1000 and off_steps == 0  # the fast paths under test ran (and only with them on)
    # cohort-only steps that end past a member's horizon (the next arrival) begun without a plan, their end
    # an event of its own (Instance.cohort_run_begin, Scheduler.cohort_step_end)
    assert crossing > 100 and off_crossing == 0
    # steps that are the cohort plus one prompt chunk, executed and applied without the general path
    # (Instance.step's fast path: SimExecutor.execute_cohort_chunk, Scheduler.cohort_chunk_end)
    assert chunk > 100 and off_chunk == 0
    # arrivals a member of the least-loaded cluster ran past, proven to go to another (cluster/route_ahead.py)
    assert passes > 100 and off_passes == 0
    assert len(on) == len(off)
    for i, (a, b) in enumerate(zip(on, off)):
        assert a == b, f"output {i} differs"
