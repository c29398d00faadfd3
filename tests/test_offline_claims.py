"""BlendServe's claims on jobs with a known answer: a crafted job whose best schedule is a blend (DFS runs its
compute-heavy and memory-heavy halves one after the other), so blendserve must beat the DFS orders by a clear
margin while keeping the DFS sharing; its gain must come from its mechanisms (the per-step prefill budgets,
the live dual-scan admission, the memory split's orientation), each checked where it acts; and the overlap
planners must run in overlap mode."""

from __future__ import annotations

import numpy as np
import pytest

from kvbalance.offline.admission import DualScanAdmission
from kvbalance.offline.density import DensityConstants, comp_s, mem_s
from kvbalance.offline.dual_scan import ScanEnds, dual_scan
from kvbalance.offline.plan import PLANNERS, PlanContext
from kvbalance.offline.simulate import OfflineEngineConfig, job_yardsticks, simulate_plan
from kvbalance.request import Request, RequestState, SamplingParams
from kvbalance.workloads.tokens import SyntheticPrompt

MODEL = "llama-2-7b"  # multi-head KV (0.5 MB a token): a 1,000-token output is already memory-heavy
CTX = PlanContext(model=MODEL)
K = DensityConstants.for_model(MODEL, CTX.gpu)
ENGINE = OfflineEngineConfig()


def blend_job(
    n_compute: int = 1200, n_memory: int = 140, d_memory: int = 1000, seed: int = 0
) -> list[Request]:
    """Compute-heavy requests (a shared 512-token prefix + 300-700 own tokens, 1-3 output tokens) and
    memory-heavy ones (a shared 64-token prefix + up to 32 own, ~1,000 output tokens), in random order. The
    memory-heavy ones all fit in the KV memory at once, so the best schedule decodes them together from the
    start and spreads the compute-heavy prefills over their decode steps."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n_compute):
        n = 512 + int(rng.integers(300, 700))
        prompt = SyntheticPrompt(n, i, np.arange(0, 32), 16, shared_len=512)
        reqs.append(
            Request(f"c{i}", prompt, SamplingParams(max_tokens=int(rng.integers(1, 4)), ignore_eos=True))
        )
    for j in range(n_memory):
        prompt = SyntheticPrompt(
            64 + int(rng.integers(0, 32)), n_compute + j, np.arange(100, 104), 16, shared_len=64
        )
        d = int(d_memory * (0.8 + 0.4 * rng.random()))
        reqs.append(Request(f"m{j}", prompt, SamplingParams(max_tokens=d, ignore_eos=True)))
    return [reqs[k] for k in rng.permutation(len(reqs))]


@pytest.fixture(scope="module")
def blend_runs():
    reqs = blend_job()
    ys = job_yardsticks(reqs, CTX, ENGINE)
    out = {}
    for name, opts in (
        ("blendserve", {}),
        ("blendserve/no-budgets", {"enforce_budgets": False}),
        ("blendserve/credit-only", {"pace_engine": False}),
        ("nanoflow-dfs", {}),
        ("vllm-dfs", {}),
    ):
        planner = PLANNERS.get(name.split("/")[0])(**opts)
        out[name] = simulate_plan(reqs, planner.plan(reqs, CTX), CTX, ENGINE, yardsticks=ys)
    return out


def _speedup(runs, a, b):
    return runs[a].throughput_tokens_per_s / runs[b].throughput_tokens_per_s


def test_blendserve_beats_the_dfs_orders_on_a_job_whose_best_schedule_is_a_blend(blend_runs):
    # measured 1.29x over nanoflow-dfs and 1.31x over vllm-dfs (a cost-model change moves it by a few %);
    # an order without the blend (plain DFS, the static order alone, no budgets) measures 1.00-1.05x
    assert _speedup(blend_runs, "blendserve", "nanoflow-dfs") >= 1.2
    assert _speedup(blend_runs, "blendserve", "vllm-dfs") >= 1.2
    # ... while keeping DFS's sharing (the paper: >= 97%)
    assert blend_runs["blendserve"].sharing_ratio >= 0.97 * blend_runs["vllm-dfs"].sharing_ratio
    # and reaching most of the practical optimum (measured 87%; nanoflow-dfs 66%)
    assert blend_runs["blendserve"].optimal_fraction >= 0.8
    assert blend_runs["blendserve"].optimal_fraction > blend_runs["nanoflow-dfs"].optimal_fraction + 0.1
    assert all(r.output_tokens == blend_runs["vllm-dfs"].output_tokens for r in blend_runs.values())


def test_the_gain_needs_the_per_step_prefill_budgets(blend_runs):
    # without C_L / C_R the compute side is admitted as fast as memory allows: bursts of compute-only steps,
    # then memory-only ones (measured 1.24x between them, step imbalance 0.39 vs 0.76)
    assert _speedup(blend_runs, "blendserve", "blendserve/no-budgets") >= 1.12
    assert blend_runs["blendserve"].step_imbalance < blend_runs["blendserve/no-budgets"].step_imbalance - 0.2


def test_the_gain_needs_the_engine_chunked_at_the_budgets(blend_runs):
    # with the budgets pacing releases only, a released prompt is prefilled whole in one step (the engine's
    # 2,048-token budget): compute-bound steps, then memory-bound ones with nothing under them (measured
    # 1.053x between them, step imbalance 0.28 vs 0.39, 87.0% vs 82.6% of the practical optimum)
    assert _speedup(blend_runs, "blendserve", "blendserve/credit-only") >= 1.03
    assert (
        blend_runs["blendserve"].step_imbalance < blend_runs["blendserve/credit-only"].step_imbalance - 0.07
    )


class _Sched:
    def __init__(self, running, budget):
        from kvbalance.scheduler.config import SchedulerConfig

        self.running = running
        self.config = SchedulerConfig(max_num_batched_tokens=budget)


class _PacedEngine:
    """An instance as the admission's pacing sees it: a scheduler with running requests and a config."""

    def __init__(self, budget: int = 2048) -> None:
        self.scheduler = _Sched([], budget)

    def add_request(self, req, now):
        return True


def test_pacing_sets_the_engines_token_budget_to_decodes_plus_the_budgets():
    reqs, p, d, comp, mem, rho_root = _two_sided()
    adm = DualScanAdmission([], list(range(len(reqs))), p, d, comp, mem, rho_root, 100_000).bind(reqs)
    eng = _PacedEngine()
    decoding = reqs[-3:]  # three memory-heavy requests one token from their next decode
    for r in decoding:
        r.num_computed_tokens = r.num_prompt_tokens - 1
    eng.scheduler.running = [*decoding, reqs[0]]  # and one compute-heavy request mid-prompt
    adm.before_step(eng, 0.0)
    c_l, c_r = adm.budgets
    assert 0 < c_l + c_r < 2048
    assert eng.scheduler.config.max_num_batched_tokens == 3 + max(128, c_l + c_r)
    adm.left, adm.right = 1, 0  # the scan has released everything: the engine's own budget returns
    adm.before_step(eng, 1.0)
    assert eng.scheduler.config.max_num_batched_tokens == 2048
    off = DualScanAdmission(
        [], list(range(len(reqs))), p, d, comp, mem, rho_root, 100_000, pace_engine=False
    ).bind(reqs)
    eng2 = _PacedEngine()
    off.before_step(eng2, 0.0)
    assert eng2.scheduler.config.max_num_batched_tokens == 2048


def test_blendserve_plans_a_live_dual_scan_admission():
    reqs = blend_job(200, 20, 200)
    plan = PLANNERS.get("blendserve")().plan(reqs, CTX)
    assert isinstance(plan.admission, DualScanAdmission) and plan.admission.feeds
    assert plan.admission.enforce_budgets
    static = PLANNERS.get("blendserve")(live_admission=False).plan(reqs, CTX)
    assert static.admission is None and static.order == plan.order


def mixed_job() -> list[Request]:
    """One prefix group of requests with a few hundred output tokens: continuous batching mixes prefill
    chunks with decodes in most steps, which is where overlapping operators pays."""
    rng = np.random.default_rng(1)
    return [
        Request(
            f"r{i}",
            SyntheticPrompt(int(rng.integers(600, 1400)), i, np.arange(0, 8), 16, shared_len=128),
            SamplingParams(max_tokens=int(rng.integers(100, 400)), ignore_eos=True),
        )
        for i in range(400)
    ]


def test_overlap_planners_run_in_overlap_mode_and_it_pays_on_mixed_steps():
    reqs = mixed_job()
    for name in ("nanoflow-dfs", "nanoflow-balance", "blendserve", "density-balance"):
        assert PLANNERS.get(name)().plan(reqs, CTX).mode == "overlap", name
    for name in ("vllm-dfs", "sglang-dfs", "sglang-lpm", "fcfs"):
        assert PLANNERS.get(name)().plan(reqs, CTX).mode == "sequential", name
    seq = simulate_plan(reqs, PLANNERS.get("vllm-dfs")().plan(reqs, CTX), CTX, ENGINE)
    ovl = simulate_plan(reqs, PLANNERS.get("nanoflow-dfs")().plan(reqs, CTX), CTX, ENGINE)
    assert ovl.num_steps == seq.num_steps  # same order, same schedule: only the step times differ
    assert seq.makespan_s / ovl.makespan_s >= 1.08  # measured 1.15x


# -- the live admission's two limits, step by step ---------------------------------------------------------
class _Engine:
    """Stands in for an instance: records what the admission releases; ``finish`` ends requests."""

    def __init__(self) -> None:
        self.added: list[Request] = []
        self.scheduler = _Sched([], 2048)  # the pacing sets its budget

    def add_request(self, req, now):
        self.added.append(req)
        return True


def _two_sided(n_compute=200, n_memory=40):
    """Compute-heavy requests (600-token prompts, 2 output tokens) then memory-heavy ones (64, 3,000): a
    density-ordered sequence, left end compute-heavy."""
    p = np.array([600.0] * n_compute + [64.0] * n_memory)
    d = np.array([2.0] * n_compute + [3000.0] * n_memory)
    comp, mem = comp_s(p, d, K), mem_s(p, d, K)
    reqs = [Request(f"q{i}", [1] * int(p[i]), max_tokens=int(d[i])) for i in range(len(p))]
    rho_root = float(comp.sum() / mem.sum())
    return reqs, p, d, comp, mem, rho_root


def test_memory_heavy_side_gets_the_large_share_and_runs_together():
    reqs, p, d, comp, mem, rho_root = _two_sided()
    m = 100_000
    adm = DualScanAdmission([], list(range(len(reqs))), p, d, comp, mem, rho_root, m).bind(reqs)
    eng = _Engine()
    for step in range(30):
        adm.before_step(eng, float(step))
        if step == 0:
            m_left, m_right = adm.split
    assert m_right > 0.9 * m > m_left  # rho_L M_L + rho_R M_R = rho_root M with rho_L >> rho_root > rho_R
    assert m_left * comp[0] / mem[0] + m_right * comp[-1] / mem[-1] == pytest.approx(rho_root * m, rel=0.02)
    # the 40 memory-heavy requests (64 + 3000 / 2 tokens each, 62.6k in all) fit M_R: all run together,
    # released at the memory side's prefill budget (128 tokens = 2 of them per step)
    memory_side = [r for r in eng.added if r.max_tokens == 3000]
    assert len(memory_side) == 40
    assert adm.used[1] == pytest.approx(40 * (64 + 1500))


def test_compute_side_is_paced_by_its_per_step_budget():
    reqs, p, d, comp, mem, rho_root = _two_sided()
    adm = DualScanAdmission([], list(range(len(reqs))), p, d, comp, mem, rho_root, 100_000).bind(reqs)
    eng = _Engine()
    released, budgets = [], []
    for step in range(40):
        adm.before_step(eng, float(step))
        released.append(adm.released_tokens[-1][0])
        budgets.append(adm.budgets[0])
        for r in eng.added:
            if r.max_tokens == 2:  # compute-heavy requests finish within a step or two
                r.state = RequestState.FINISHED
    assert 0 < budgets[0] < 600  # the budget binds: memory alone would let far more of the left side in
    assert all(x <= c + 600 for x, c in zip(released, budgets))  # one request may overdraw a step's credit
    assert sum(released) <= sum(budgets) + 600  # on the whole, C_L tokens per step and no more
    assert sum(released) >= 0.6 * sum(budgets)
    unpaced = DualScanAdmission(
        [], list(range(len(reqs))), p, d, comp, mem, rho_root, 100_000, enforce_budgets=False
    ).bind(reqs)
    unpaced.before_step(_Engine(), 0.0)
    assert unpaced.released_tokens[0][0] > 3 * budgets[0]  # without it, a burst


def test_fluid_scan_spends_each_step_at_most_its_budgets():
    reqs, p, d, comp, mem, rho_root = _two_sided()
    seq = list(range(len(reqs)))
    paced = dual_scan(seq, p, d, comp, mem, rho_root, 100_000, 2048)
    unpaced = dual_scan(seq, p, d, comp, mem, rho_root, 100_000, 2048, enforce_budgets=False)
    assert sorted(paced.order) == seq and sorted(unpaced.order) == seq
    assert 0 < paced.c_left_tokens < 2048
    first = [sum(p[i] for i in b if d[i] == 2) for b in paced.batches[:20]]
    assert max(first) <= paced.c_left_tokens + 600
    # unpaced, the first admission takes as much of the left side as its memory allows
    assert sum(p[i] for i in unpaced.batches[0] if d[i] == 2) > 3 * paced.c_left_tokens
    assert paced.steps > unpaced.steps * 0.5  # pacing spreads the compute side over the scan's steps


def test_aligned_budget_is_the_compute_left_over_the_memory_steps_left():
    reqs, p, d, comp, mem, rho_root = _two_sided()
    ends = ScanEnds(comp, mem, p, d, rho_root)
    # 200 x 600 compute tokens; 40 memory-heavy requests of 3,000 steps, all fit at once: 3,000 steps
    assert ends.aligned_budget(0, len(p) - 1, 100_000, 2048) == 40
    # 10 of them running with 1,000 steps left each, 30 pending: (30 x 3000 + 10 x 1000) / 40 = 2,500 steps
    assert ends.aligned_budget(0, len(p) - 11, 100_000, 2048, (10, 10_000.0, 1000.0)) == 48
    # only a long one left running: its remaining steps bound the pace; nothing memory-heavy left: full speed
    assert ends.aligned_budget(0, 199, 100_000, 2048, (1, 500.0, 500.0)) == 240
    assert ends.aligned_budget(0, 199, 100_000, 2048) == 2048


def test_aligned_scan_ends_the_compute_side_with_the_memory_side():
    reqs, p, d, comp, mem, rho_root = _two_sided()
    seq = list(range(len(reqs)))
    res = dual_scan(seq, p, d, comp, mem, rho_root, 100_000, 2048)
    last_compute = max(t for i, t in zip(res.order, res.admit_step) if d[i] == 2)
    assert last_compute >= 0.85 * res.steps  # compute spread over the memory side's steps, to its end
    paper = dual_scan(seq, p, d, comp, mem, rho_root, 100_000, 2048, budget_rule="paper")
    assert sorted(paper.order) == seq and paper.c_left_tokens != res.c_left_tokens
    with pytest.raises(ValueError, match="budget_rule: must be one of aligned, paper"):
        dual_scan(seq, p, d, comp, mem, rho_root, 100_000, 2048, budget_rule="fast")


def test_aligned_budget_counts_the_memory_sides_kv_area():
    # compute-heavy: 100 x 600 prompt tokens; memory-heavy: one 20,000-token decode among 100 of 1,000 tokens.
    # By count, all 101 fit a 100k-token share at once (100 x 516 + 10,016 on average) and their 120,000
    # output tokens take ~1,200 steps; by area the long one alone holds 200M KV-token-steps, 2,000 steps of
    # the share, so the compute side must be paced over at least those.
    p = np.array([600.0] * 100 + [16.0] * 101)
    d = np.array([2.0] * 100 + [20_000.0] + [1_000.0] * 100)
    mem = mem_s(p, d, K)
    comp = np.where(d > 2, 0.01, 100.0) * mem  # the two kinds, whatever the model's constants
    rho_root = float(comp.sum() / mem.sum())
    n = len(p)
    ends = ScanEnds(comp, mem, p, d, rho_root, area=True)
    assert ends.heavy.sum() == 101
    by_count = ScanEnds(comp, mem, p, d, rho_root).aligned_budget(0, n - 1, 100_000, 2048)
    by_area = ends.aligned_budget(0, n - 1, 100_000, 2048)
    area = 16 * 20_000 + 20_000**2 / 2 + 100 * (16 * 1_000 + 1_000**2 / 2)
    assert by_count == int(np.ceil(100 * 600 / (121_000 / 101)))
    assert by_area == int(np.ceil(100 * 600 / (area / 100_000)))
    assert by_count > 1.5 * by_area
