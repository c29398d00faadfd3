"""The scheduler's side of the KV connector, pinned exactly: how many external tokens are allowed, what the
connector is told, when held blocks go, and that loaded KV joins the prefix cache."""

from __future__ import annotations

import pytest
from conftest import make_request

from kvbalance.batch import BatchPlan, StepResult
from kvbalance.kvcache.blocks import BlockPool
from kvbalance.kvcache.connector import NullConnector
from kvbalance.request import RequestState
from kvbalance.scheduler import Scheduler, SchedulerConfig


class ScriptedConnector:
    """Offers ``external`` tokens to every request; records every call; holds blocks when ``hold``."""

    def __init__(self, external: int, load_async: bool, hold: bool = False) -> None:
        self.external, self.load_async, self.hold = external, load_async, hold
        self.allocs: list[tuple[str, list[int], int]] = []
        self.outputs: list[tuple[list[str], list[str]]] = []
        self.finished: list[tuple[str, list[int]]] = []
        self.metas = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.external, self.load_async

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, plan):
        self.metas += 1

    def update_connector_output(self, finished_loads, finished_saves):
        self.outputs.append((list(finished_loads), list(finished_saves)))

    def request_finished(self, request, block_ids):
        self.finished.append((request.request_id, list(block_ids)))
        return self.hold


def _scheduler(conn, num_blocks=32):
    cfg = SchedulerConfig(max_num_batched_tokens=64, watermark=0.0)
    return Scheduler(cfg, BlockPool(num_blocks, 4), conn)


def _apply(sched, plan, now=0.0, loads=(), saves=()):
    sampled = {s.request.request_id: 7 for s in plan.seqs if s.sample}
    return sched.update(
        plan, StepResult(0.01, sampled, finished_loads=list(loads), finished_saves=list(saves)), now
    )


def test_connector_may_offer_all_but_the_last_token_and_no_more():
    sched = _scheduler(ScriptedConnector(external=9, load_async=False))
    req = make_request("r", 10, max_tokens=2)
    sched.add(req)
    plan = sched.schedule(0.0)
    assert [(s.start, s.num_new_tokens, s.sample) for s in plan.seqs] == [(9, 1, True)]
    assert sched.external_hit_tokens == 9
    too_many = _scheduler(ScriptedConnector(external=10, load_async=False))
    too_many.add(make_request("r", 10))
    with pytest.raises(
        ValueError, match=r"num_external_tokens: connector offered 10 tokens for r, must be in \[0, 9\]"
    ):
        too_many.schedule(0.0)
    negative = _scheduler(ScriptedConnector(external=-1, load_async=False))
    negative.add(make_request("r", 10))
    with pytest.raises(ValueError, match="num_external_tokens"):
        negative.schedule(0.0)


def test_connector_is_told_the_blocks_and_tokens_of_each_admission():
    conn = ScriptedConnector(external=8, load_async=False)
    sched = _scheduler(conn)
    req = make_request("r", 10, max_tokens=2)
    sched.add(req)
    sched.schedule(0.0)
    assert conn.allocs == [("r", [2, 1, 0], 8)] and conn.metas == 1  # ids come off the top of the free stack


def test_async_load_waits_then_runs_from_the_loaded_tokens_and_caches_them():
    conn = ScriptedConnector(external=8, load_async=True)
    sched = _scheduler(conn)
    req = make_request("r", list(range(10)), max_tokens=2)
    sched.add(req)
    plan = sched.schedule(0.0)
    assert plan.seqs == [] and req.state is RequestState.WAITING_FOR_KV and sched.num_loading == 1
    assert req.num_computed_tokens == 0 and len(req.block_ids) == 2  # blocks for the 8 loaded tokens
    _apply(sched, plan)
    _apply(sched, sched.schedule(1.0), loads=["r"], saves=["other"])
    assert conn.outputs[-1] == (["r"], ["other"])
    assert req.state is RequestState.RUNNING and req.num_computed_tokens == 8 and sched.num_loading == 0
    assert sched.cache.num_cached_blocks == 2  # the loaded blocks are published in the prefix cache
    plan = sched.schedule(2.0)
    assert [(s.start, s.num_new_tokens, s.sample) for s in plan.seqs] == [(8, 2, True)]
    sched.check_invariants()


def test_a_zero_token_load_is_never_asynchronous():
    sched = _scheduler(ScriptedConnector(external=0, load_async=True))
    req = make_request("r", 6, max_tokens=1)
    sched.add(req)
    plan = sched.schedule(0.0)
    assert [(s.start, s.num_new_tokens) for s in plan.seqs] == [(0, 6)] and req.state is RequestState.RUNNING


def _finish_with_a_held_save(check: bool):
    conn = ScriptedConnector(external=0, load_async=False, hold=True)
    sched = _scheduler(conn)
    req = make_request("r", 8, max_tokens=1)
    sched.add(req)
    plan = sched.schedule(0.0)
    blocks = list(req.block_ids)
    assert _apply(sched, plan) == [req]
    assert conn.finished == [("r", blocks)] and req.block_ids == []
    assert all(sched.pool.ref_count(b) == 2 for b in blocks)  # the cache's and the held save's
    if check:
        sched.check_invariants()
    _apply(sched, sched.schedule(1.0), loads=["r"])  # a load report for r does not free a save's blocks
    assert all(sched.pool.ref_count(b) == 2 for b in blocks)
    _apply(sched, sched.schedule(2.0), saves=["r"])
    assert all(sched.pool.ref_count(b) == 1 for b in blocks)  # only the cache's reference is left
    sched.check_invariants()


def test_finished_request_blocks_are_held_until_its_save_lands():
    _finish_with_a_held_save(check=False)


def test_invariants_hold_while_a_finished_requests_cached_blocks_wait_for_their_save():
    _finish_with_a_held_save(check=True)


def test_abort_while_loading_holds_blocks_until_the_load_not_a_save_lands():
    conn = ScriptedConnector(external=8, load_async=True)
    sched = _scheduler(conn)
    req = make_request("r", 10, max_tokens=2)
    sched.add(req)
    _apply(sched, sched.schedule(0.0))
    blocks = list(req.block_ids)
    sched.abort(req, 1.0)
    assert req.state is RequestState.ABORTED and conn.finished == [("r", blocks)]
    assert sched.num_loading == 0 and all(sched.pool.ref_count(b) == 1 for b in blocks)
    _apply(sched, sched.schedule(2.0), saves=["r"])  # a save report does not free a load's blocks
    assert all(sched.pool.ref_count(b) == 1 for b in blocks)
    _apply(sched, sched.schedule(3.0), loads=["r"])
    assert sched.pool.num_free == 32 and sched._load_target == {} and sched._held == {}
    sched.check_invariants()


def test_aborting_a_running_request_tells_the_connector_and_may_hold_its_blocks():
    conn = ScriptedConnector(external=0, load_async=False, hold=True)
    sched = _scheduler(conn)
    req = make_request("r", 6, max_tokens=4)
    sched.add(req)
    _apply(sched, sched.schedule(0.0))
    blocks = list(req.block_ids)
    sched.abort(req, 1.0)
    assert conn.finished == [("r", blocks)] and req.block_ids == [] and sched.num_running == 0
    assert all(sched.pool.ref_count(b) >= 1 for b in blocks)  # held until the save lands
    _apply(sched, sched.schedule(2.0), saves=["r"])
    assert sched.pool.num_free + sched.cache.num_cached_blocks == 32


def test_the_null_connector_offers_nothing_and_holds_nothing():
    null, req = NullConnector(), make_request("r", 8)
    assert null.get_num_new_matched_tokens(req, 0) == (0, False)
    assert null.request_finished(req, [1, 2]) is False
    assert null.update_state_after_alloc(req, [1], 4) is None
    plan = BatchPlan(block_size=4)
    null.build_connector_meta(plan)
    assert plan.kv_loads == [] and plan.kv_saves == []


def test_external_tokens_are_bounded_after_a_prefix_hit():
    # a 4-token prefix hit on a 10-token prompt leaves at most 10 - 1 - 4 = 5 tokens to load
    conn = ScriptedConnector(external=0, load_async=False)
    sched = _scheduler(conn)
    first = make_request("first", list(range(10)), max_tokens=1)
    sched.add(first)
    _apply(sched, sched.schedule(0.0))
    conn.external = 6
    sched.add(make_request("r", list(range(4)) + [50, 51, 52, 53, 54, 55], max_tokens=1))
    with pytest.raises(ValueError, match=r"must be in \[0, 5\] \(the last token is always computed\)"):
        sched.schedule(1.0)
    conn.external = 5
    plan = sched.schedule(2.0)
    assert [(s.start, s.num_new_tokens) for s in plan.seqs] == [(9, 1)] and sched.external_hit_tokens == 5


def test_a_one_token_async_load_still_waits_for_its_kv():
    sched = _scheduler(ScriptedConnector(external=1, load_async=True))
    req = make_request("r", 6, max_tokens=1)
    sched.add(req)
    assert sched.schedule(0.0).seqs == [] and req.state is RequestState.WAITING_FOR_KV
