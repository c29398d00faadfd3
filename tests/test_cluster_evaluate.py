"""The SLO-rate search (bracket, then bisection to a resolution) and the exact early exit of its probes."""

from __future__ import annotations

import math

import pytest

from kvbalance.cluster.config import ClusterConfig, InstanceGroup
from kvbalance.cluster.core import sim_member
from kvbalance.cluster.evaluate import SloCounter, SloVerdict, Workbench, search_max_rate
from kvbalance.cluster.lazy_load import LazyLoad
from kvbalance.request import Request, RequestState
from kvbalance.sim.run import SimulateConfig


def test_search_brackets_then_bisects_to_the_resolution():
    seen = []

    def ok(r):  # the threshold: 37 req/s
        seen.append(r)
        return r <= 37.0

    rate = search_max_rate(ok, 8.0, resolution=0.05)
    assert rate <= 37.0 < rate * 1.05
    assert seen[:3] == [8.0, 16.0, 64.0]  # steps x2, then x4 (the factor squares): bracket [16, 64]
    assert len(seen) == 3 + math.ceil(math.log2(math.log(4) / math.log(1.05)))  # geometric halvings
    seen.clear()
    assert search_max_rate(ok, 36.0, resolution=0.1, factor=1.1) == 36.0 and seen == [36.0, 39.6]
    assert search_max_rate(lambda r: False, 8.0, max_brackets=3) == 0.0
    with pytest.raises(ValueError, match="resolution"):
        search_max_rate(ok, 8.0, resolution=0.0)


def _req(i: int, ttft: float, ok: bool = True) -> Request:
    r = Request(f"r{i}", [1, 2, 3], max_tokens=1)
    r.state = RequestState.FINISHED if ok else RequestState.REJECTED
    r.first_token_s, r.finish_s = ttft, ttft
    return r


def test_slo_counter_decides_exactly_when_the_outcome_is_certain():
    c = SloCounter(10, 0.9, ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert c.need == 9  # 9 / 10 >= 0.9, 8 / 10 is not
    c(_req(0, 2.0))  # one miss: 9 of the other 9 could still meet it
    with pytest.raises(SloVerdict) as v:
        c(_req(1, 0.5, ok=False))  # a second miss (rejected): at most 8 / 10
    assert not v.value.passed and v.value.missed == 2
    c = SloCounter(10, 0.9, ttft_slo_s=1.0, tpot_slo_s=0.1)
    for i in range(8):
        c(_req(i, 0.5))
    with pytest.raises(SloVerdict) as v:
        c(_req(8, 0.5))
    assert v.value.passed and v.value.good == 9
    assert SloCounter(3, 0.9, 1.0, 0.1).need == 3 and SloCounter(1000, 0.9, 1.0, 0.1).need == 900


def _bench(early_exit: bool) -> Workbench:
    return Workbench("llama-2-7b", "a100-80gb", "uniform:200-600:20-60", "gamma", 2.0, 0.3, 0.04, duration_s=4.0,
                     min_requests=40, max_requests=160, early_exit=early_exit)  # fmt: skip


def test_early_exit_gives_the_verdicts_and_the_rate_of_full_runs():
    cfg = ClusterConfig(instances=[InstanceGroup(count=2)], router="least_loaded")
    fast, full = _bench(True), _bench(False)
    rates = (10.0, 30.0, 50.0)
    assert [fast.passes(cfg, r) for r in rates] == [full.passes(cfg, r) for r in rates] == [True, True, False]
    assert fast.stopped_probes == 3 and full.stopped_probes == 0
    assert [e for *_, e in fast.probes[fast.key(cfg)]] == [False] * 3
    assert [e for *_, e in full.probes[full.key(cfg)]] == [True] * 3
    for (_, a_fast, _), (_, a_full, _) in zip(fast.probes[fast.key(cfg)], full.probes[full.key(cfg)]):
        assert (a_fast <= a_full) if a_full >= 0.9 else (a_fast >= a_full)  # a bound on the verdict's side
    assert fast.max_rate_at_slo(cfg, 20.0) == full.max_rate_at_slo(cfg, 20.0) > 30.0


def test_lazy_load_reads_what_instance_load_reports():
    m = sim_member(0, "colocated", (0,), SimulateConfig(model="llama-2-7b", gpu="a100-80gb"))
    m.instance.add_request(Request("a", list(range(100)), max_tokens=8), 0.0)
    full, lazy = m.instance.load(), LazyLoad(m.instance)
    for f in ("name", "num_waiting", "num_running", "num_loading", "kv_used_tokens", "kv_capacity_tokens",
              "busy_s", "queued_prefill_tokens", "outstanding_tokens", "kv_utilization"):  # fmt: skip
        assert getattr(lazy, f) == getattr(full, f), f
