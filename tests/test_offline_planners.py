"""Every planner schedules every request exactly once; ranks are balanced partitions; SGLang's LPM fallback."""

import pytest

from kvbalance.engine import Instance
from kvbalance.executor.sim import SimExecutor
from kvbalance.offline.density import DensityConstants
from kvbalance.offline.plan import PLANNERS, OfflinePlan, PlanContext
from kvbalance.offline.planners.sglang_lpm import LPMAdmission
from kvbalance.offline.simulate import OfflineEngineConfig, simulate_plan
from kvbalance.perf.cost import CostModel
from kvbalance.request import Request
from kvbalance.workloads.offline import OfflineJobConfig, build_job

CTX = PlanContext(kv_capacity_tokens=40_000, chunk_tokens=512)
K = DensityConstants.for_model(CTX.model, CTX.gpu)
ALL = (
    "fcfs",
    "vllm-dfs",
    "sglang-dfs",
    "sglang-lpm",
    "nanoflow-dfs",
    "nanoflow-balance",
    "density-balance",
    "blendserve",
)


@pytest.fixture(scope="module")
def job():
    return build_job(
        OfflineJobConfig(num_requests=160, video_fraction=0.05, video_output_mean_tokens=400, seed=2)
    )


def test_registry_lists_every_planner():
    assert set(PLANNERS.names()) == set(ALL)
    with pytest.raises(ValueError, match="planner: unknown 'nope'"):
        PLANNERS.get("nope")


@pytest.mark.parametrize("name", ALL)
def test_every_request_is_scheduled_exactly_once(job, name):
    plan = PLANNERS.get(name)().plan(job, CTX)
    assert sorted(plan.order) == list(range(len(job)))
    res = simulate_plan(job, plan, CTX, OfflineEngineConfig(max_num_seqs=128))
    assert res.output_tokens == sum(r.max_tokens for r in job)
    assert res.input_tokens == sum(r.num_prompt_tokens for r in job)
    assert res.makespan_s > 0 and 0 <= res.sharing_ratio < 1
    assert res.ideal_fraction <= 1.0 + 1e-9  # nobody beats the ideal bound
    for n in (1, 2, 3):
        ranks = plan.ranks(n)
        assert len(ranks) == n
        assert sorted(i for r in ranks for i in r) == list(range(len(job)))


@pytest.mark.parametrize("name", ["blendserve", "vllm-dfs", "fcfs"])
def test_ranks_are_balanced(job, name):
    plan = PLANNERS.get(name)().plan(job, CTX)
    w = [r.num_prompt_tokens + r.max_tokens for r in job]
    loads = [sum(w[i] for i in rank) for rank in plan.ranks(4)]
    assert max(loads) <= 1.6 * sum(loads) / 4


def test_blendserve_plan_keeps_the_sharing_and_reports_its_parts(job):
    plan = PLANNERS.get("blendserve")().plan(job, CTX)
    s = plan.stats
    assert s["sharing_kept"] >= 0.99
    assert s["m_left_tokens"] + s["m_right_tokens"] == pytest.approx(CTX.kv_capacity_tokens)
    assert plan.order[: len(plan.warmup)] == plan.warmup  # the warm-up runs first
    assert len(plan.warmup) >= 1 and s["estimate_mean_abs_rel_error"] is not None


def test_same_seed_same_result(job):
    plan = PLANNERS.get("blendserve")().plan(job, CTX)
    a = simulate_plan(job, plan, CTX, OfflineEngineConfig(max_num_seqs=128)).row()
    b = simulate_plan(
        job, PLANNERS.get("blendserve")().plan(job, CTX), CTX, OfflineEngineConfig(max_num_seqs=128)
    )
    assert a == b.row()


def test_plan_rejects_an_order_that_repeats_a_request():
    with pytest.raises(ValueError, match="order: must list every request"):
        OfflinePlan("x", [0, 1, 1])


def _instance():
    cm = CostModel("llama-3.1-8b", "a100-80gb")
    return Instance(SimExecutor(cm), num_blocks=4000, block_size=16)


def test_lpm_is_fcfs_past_128_waiting_and_longest_match_first_below():
    shared = list(range(1000, 1064))  # 4 blocks
    inst = _instance()
    warm = Request("warm", shared + [1] * 8, max_tokens=1)
    inst.add_request(warm, 0.0)
    out = inst.step(0.0)
    inst.complete(out, out.result.duration_s)  # the shared prefix is now cached
    cold = [Request(f"c{i}", [5000 + i] * 70, max_tokens=1) for i in range(129)]
    hot = Request("hot", shared + [2] * 8, max_tokens=1)
    for r in [*cold, hot]:
        inst.add_request(r, 0.0)
    lpm = LPMAdmission()
    lpm.before_step(inst, 0.0)
    assert inst.scheduler.waiting[-1] is hot  # 130 waiting: FCFS
    inst.scheduler.waiting.popleft()
    inst.scheduler.waiting.popleft()
    lpm.before_step(inst, 0.0)
    assert inst.scheduler.waiting[0] is hot  # 128 waiting: longest prefix match first
    assert [r.request_id for r in list(inst.scheduler.waiting)[1:4]] == ["c2", "c3", "c4"]  # FCFS among ties
