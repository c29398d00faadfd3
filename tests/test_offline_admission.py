"""Dual-scan admission on the live engine and the in-batch prefix check."""

import numpy as np

from kvbalance.offline.admission import DualScanAdmission
from kvbalance.offline.plan import OfflinePlan, PlanContext
from kvbalance.offline.simulate import OfflineEngineConfig, simulate_plan
from kvbalance.request import Request


class _FakeInstance:
    def __init__(self):
        self.added = []

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
