"""Dual-scan admission on the live engine and the in-batch prefix check."""

import numpy as np
import pytest

from kvbalance.offline.admission import DualScanAdmission
from kvbalance.offline.plan import OfflinePlan, PlanContext
from kvbalance.offline.simulate import OfflineEngineConfig, simulate_plan
from kvbalance.request import Request


class _FakeInstance:
    def __init__(self):
        from types import SimpleNamespace

        from kvbalance.scheduler.config import SchedulerConfig

        self.added = []
        self.scheduler = SimpleNamespace(running=[], config=SchedulerConfig(max_num_batched_tokens=2048))

    def add_request(self, req, now):
        self.added.append(req)
        return True


def test_dual_scan_admission_feeds_both_ends_within_the_memory_split():
    n = 20
    reqs = [Request(f"r{i}", [1] * 100, max_tokens=10 + 100 * i) for i in range(n)]
    p = np.full(n, 100.0)
    d = np.array([r.max_tokens for r in reqs], dtype=float)
    mem = p * d + d * d / 2
    comp = 1000.0 * (p + d)  # density falls with i
    rho_root = comp.sum() / mem.sum()
    adm = DualScanAdmission([0], list(range(1, n)), p, d, comp, mem, rho_root, m_tokens=3000).bind(reqs)
    inst = _FakeInstance()
    adm.before_step(inst, 0.0)
    first = [r.request_id for r in inst.added]
    assert first[0] == "r0" and "r1" in first and "r19" in first  # warm-up, then both ends
    assert sum(adm.used) <= 3000 + max(adm.foot)  # each side within its share (one may overshoot by one)
    while adm.pending:
        for r in inst.added:
            r.state = r.state.__class__.FINISHED  # everything released so far finishes
        adm.before_step(inst, 1.0)
    ids = [r.request_id for r in inst.added]
    assert sorted(ids) == sorted(r.request_id for r in reqs) and len(ids) == len(set(ids))


def _group_job():
    shared = list(range(5000, 5000 + 64))  # 4 blocks of 16
    return [Request(f"g{i}", shared + [i + 1] * 20, max_tokens=4) for i in range(6)]


def test_in_batch_prefix_check_lets_a_dfs_group_share_its_prefix():
    reqs = _group_job()
    ctx = PlanContext(kv_capacity_tokens=20_000, chunk_tokens=2048)
    plan = OfflinePlan("dfs", list(range(len(reqs))))
    off = simulate_plan(reqs, plan, ctx, OfflineEngineConfig(in_batch_prefix_check=False))
    on = simulate_plan(reqs, plan, ctx, OfflineEngineConfig(in_batch_prefix_check=True))
    total = sum(r.num_prompt_tokens for r in reqs)
    assert off.sharing_ratio == 0.0  # admitted together: nobody finds the prefix cached
    assert (
        on.sharing_ratio == (len(reqs) - 1) * 64 / total
    )  # the first computes it, the rest hit all 4 blocks
    assert on.output_tokens == off.output_tokens == 6 * 4


def _brute_peak(held, left):
    """The largest sum over future steps t = 0, 1, ... of the KV of the requests still running (request j
    holds held[j] + t tokens while t < left[j]), walked step by step."""
    return max(sum(k + t for k, r in zip(held, left) if t < r) for t in range(int(max(left))))


def test_peak_rule_projects_the_memory_heavy_sides_growth_exactly():
    rng = np.random.default_rng(3)
    n = 12
    reqs = [Request(f"r{i}", [1] * 8, max_tokens=100) for i in range(n)]
    p = rng.integers(10, 400, n).astype(float)
    d = rng.integers(1, 300, n).astype(float)
    mem = p * d + d * d / 2
    adm = DualScanAdmission([], list(range(n)), p, d, mem * 0.1, mem, 1.0, 1e9, memory_rule="peak").bind(reqs)
    adm.live[1] = [1, 4, 7, 9]
    for j, g in zip(adm.live[1], (0, 5, 17, 40)):
        reqs[j].output_token_ids.extend([2] * g)
    held = [p[0]] + [p[j] + reqs[j].num_output_tokens for j in adm.live[1]]
    left = [max(d[0], 1.0)] + [max(d[j] - reqs[j].num_output_tokens, 1.0) for j in adm.live[1]]
    peak = _brute_peak(held, left)
    assert adm._peak_fits(0, peak) and not adm._peak_fits(0, peak - 1)


def test_peak_rule_staggers_a_wave_of_equal_long_decodes():
    # equal memory-heavy requests of 100 prompt + 1,000 output tokens against a 6,000-token share: on averages
    # (600 tokens each) 10 start and together peak at 11,000; under the peak rule 5, which fit at full length
    n = 20
    reqs = [Request(f"r{i}", [1] * 100, max_tokens=1000) for i in range(n)]
    p, d = np.full(n, 100.0), np.full(n, 1000.0)
    mem = p * d + d * d / 2
    started = {}
    for rule in ("average", "peak"):
        adm = DualScanAdmission([], list(range(n)), p, d, mem * 0.01, mem, 1.0, 6000, memory_rule=rule).bind(
            reqs
        )
        budget = (0.0, 6000.0)
        for i in range(n):  # the memory-heavy side's loop, alone
            if not adm.memory_allows(1, i, budget):
                break
            adm.used[1] += adm.foot[i]
            adm.live[1].append(i)
        started[rule] = len(adm.live[1])
        peak = _brute_peak([p[j] for j in adm.live[1]], [d[j] for j in adm.live[1]])
        assert (peak > 6000) if rule == "average" else (peak <= 6000 < peak + 1100)
    assert started == {"average": 10, "peak": 5}
    with pytest.raises(ValueError, match="memory_rule"):
        DualScanAdmission([], [0], p, d, mem, mem, 1.0, 6000, memory_rule="max")


def test_auto_memory_rule_staggers_only_a_memory_side_of_several_generations():
    from kvbalance.offline.density import DensityConstants, comp_s, mem_s

    k = DensityConstants.for_model("llama-2-7b", "a100-80gb")

    def admission(n_memory: int) -> DualScanAdmission:
        p = np.array([600.0] * 100 + [64.0] * n_memory)
        d = np.array([2.0] * 100 + [3000.0] * n_memory)
        comp, mem = comp_s(p, d, k), mem_s(p, d, k)
        reqs = [Request(f"q{i}", [1] * int(p[i]), max_tokens=int(d[i])) for i in range(len(p))]
        rho_root = float(comp.sum() / mem.sum())
        return DualScanAdmission([], list(range(len(p))), p, d, comp, mem, rho_root, 100_000).bind(reqs)

    one = admission(10)  # 10 x (64 x 3000 + 3000^2 / 2) KV-token-steps: a fraction of one generation
    assert one.generations < 1.5 and one.memory_rule == "average"
    many = admission(200)  # 20 times as much: they cannot all run at once, starts must be staggered
    assert many.generations == pytest.approx(20 * one.generations, rel=0.05)
    assert many.generations > 1.5 and many.memory_rule == "peak"
