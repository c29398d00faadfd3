"""KV connector seam: tokens served from outside are loaded, not computed; a request waits for its KV;
an abort while the load is in flight leaks nothing."""

from __future__ import annotations

import pytest
from conftest import EchoExecutor, make_request

from kvbalance.batch import KVTransfer, StepResult
from kvbalance.engine import Instance
from kvbalance.kvcache.connector import KVConnector, NullConnector
from kvbalance.request import Request, RequestState
from kvbalance.scheduler import SchedulerConfig

BS = 4


class PeerConnector:
    """Scheduler half: the first ``external`` tokens of the prompts of ``request_ids`` can be loaded from a
    peer instance (every prompt when ``request_ids`` is None)."""

    def __init__(self, external: int, load_async: bool = True, request_ids: set[str] | None = None) -> None:
        self.external = external
        self.request_ids = request_ids
        self.load_async = load_async
        self._pending: list[KVTransfer] = []
        self.finished_loads: list[str] = []
        self.finished_requests: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.request_ids is not None and request.request_id not in self.request_ids:
            return 0, False
        return max(0, min(self.external, request.num_tokens - 1) - num_computed_tokens), self.load_async

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            first = request.num_computed_tokens // BS
            last = -(-(request.num_computed_tokens + num_external_tokens) // BS)
            self._pending.append(
                KVTransfer(request.request_id, block_ids[first:last], num_external_tokens, "load", "peer")
            )

    def build_connector_meta(self, plan) -> None:
        plan.kv_loads.extend(self._pending)
        self._pending.clear()

    def update_connector_output(self, finished_loads: list[str], finished_saves: list[str]) -> None:
        self.finished_loads.extend(finished_loads)

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self.finished_requests.append(request.request_id)
        return False


class SlowLinkExecutor(EchoExecutor):
    """Worker half: a load issued in a step is reported finished ``delay`` steps later."""

    def __init__(self, delay: int) -> None:
        super().__init__()
        self.delay = delay
        self._in_flight: list[tuple[int, str]] = []
        self.loaded: list[KVTransfer] = []

    def execute(self, plan):
        result = super().execute(plan)
        step = len(self.plans)
        for t in plan.kv_loads:
            self.loaded.append(t)
            self._in_flight.append((step + self.delay, t.request_id))
        result.finished_loads = [rid for due, rid in self._in_flight if due <= step]
        self._in_flight = [(due, rid) for due, rid in self._in_flight if due > step]
        return result


def _instance(executor, connector, num_blocks=64):
    cfg = SchedulerConfig(max_num_batched_tokens=64, watermark=0.0)
    return Instance(executor, num_blocks=num_blocks, block_size=BS, scheduler_config=cfg, connector=connector)


def _step(inst, now):
    out = inst.step(now)
    if out is None:
        return None, now
    now += out.result.duration_s
    inst.complete(out, now)
    inst.check_invariants()
    return out, now


def test_null_connector_is_a_kv_connector():
    assert isinstance(NullConnector(), KVConnector) and isinstance(PeerConnector(0), KVConnector)


def test_loaded_tokens_are_not_computed_and_decode_waits_for_the_load():
    # instance A computes the prompt; instance B loads its first 32 tokens from A and computes the rest
    prompt = list(range(100, 140))
    a = _instance(EchoExecutor(), NullConnector())
    ref = make_request("r", prompt, max_tokens=5)
    a.add_request(ref, 0.0)
    now = 0.0
    while a.has_work():
        _, now = _step(a, now)

    ex = SlowLinkExecutor(delay=3)
    conn = PeerConnector(external=32, request_ids={"r"})
    b = _instance(ex, conn)
    other = make_request("other", 12, max_tokens=20)  # keeps B stepping while the load is in flight
    req = make_request("r", prompt, max_tokens=5)
    b.add_request(other, 0.0)
    b.add_request(req, 0.0)
    out, now = _step(b, 0.0)
    assert req.state is RequestState.WAITING_FOR_KV and b.load().num_loading == 1
    assert [t.request_id for t in out.plan.kv_loads] == ["r"] and out.plan.kv_loads[0].num_tokens == 32
    assert len(out.plan.kv_loads[0].block_ids) == 8
    computed: list[tuple[int, int]] = []
    steps_waiting = 0
    while b.has_work():
        out, now = _step(b, now)
        if out is None:
            break
        for s in out.plan.seqs:
            if s.request is req:
                computed.append((s.start, s.num_new_tokens))
        if "r" not in conn.finished_loads:
            steps_waiting += 1
            assert all(s.request is not req for s in out.plan.seqs), "scheduled before its KV arrived"
    assert steps_waiting >= 2
    assert computed[0] == (32, 8)  # only the tokens after the loaded ones are computed
    assert sum(n for _, n in computed) == 8 + 4  # the rest of the prompt, then four decodes
    assert req.state is RequestState.FINISHED and req.output_token_ids == ref.output_token_ids
    assert b.scheduler.external_hit_tokens == 32
    assert b.pool.num_used == b.cache.num_cached_blocks


def test_synchronous_load_lands_in_the_step_that_computes_the_rest():
    conn = PeerConnector(external=16, load_async=False)
    b = _instance(EchoExecutor(), conn)
    req = make_request("s", 30, max_tokens=2)
    b.add_request(req, 0.0)
    out, now = _step(b, 0.0)
    assert [(s.start, s.num_new_tokens) for s in out.plan.seqs] == [(16, 14)]
    assert out.plan.kv_loads[0].num_tokens == 16


@pytest.mark.parametrize("finish_after_abort", [True, False])
def test_abort_while_loading_keeps_blocks_until_the_load_lands_then_frees_them(finish_after_abort):
    ex = SlowLinkExecutor(delay=2)
    b = _instance(ex, PeerConnector(external=24, request_ids={"gone"}), num_blocks=16)
    keep = make_request("keep", 8, max_tokens=12)
    req = make_request("gone", 40, max_tokens=4)
    b.add_request(keep, 0.0)
    b.add_request(req, 0.0)
    _, now = _step(b, 0.0)
    assert req.state is RequestState.WAITING_FOR_KV
    held = list(req.block_ids)
    assert len(held) == 6
    b.abort(req, now)
    assert req.state is RequestState.ABORTED and req.block_ids == []
    b.check_invariants()  # the held blocks are accounted for
    assert all(b.pool.ref_count(x) >= 1 for x in held)  # still owned: the load is writing into them
    if finish_after_abort:  # the load lands while "keep" still runs
        for _ in range(100):
            out, now = _step(b, now)
            if out is None:
                break
        assert keep.state is RequestState.FINISHED
        assert b.pool.num_used == b.cache.num_cached_blocks  # nothing leaked
    else:  # "keep" is aborted too before the load lands: the held blocks wait for it
        b.abort(keep, now)
        assert b.pool.num_used > b.cache.num_cached_blocks
        b.scheduler.update(b.scheduler.schedule(now), StepResult(0.0, finished_loads=["gone"]), now)
        b.check_invariants()
        assert b.pool.num_used == b.cache.num_cached_blocks


class SavingConnector(PeerConnector):
    """Every finished request's KV is saved somewhere outside: hold its blocks until the save lands."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        super().request_finished(request, block_ids)
        return True


def test_blocks_held_for_a_save_stay_locked_until_it_lands():
    b = _instance(EchoExecutor(), SavingConnector(external=0), num_blocks=16)
    req = make_request("saved", 17, max_tokens=1)  # 4 full blocks cached, a 5th partial
    b.add_request(req, 0.0)
    _step(b, 0.0)
    assert req.state is RequestState.FINISHED and req.block_ids == []
    assert b.pool.num_used == 5 and b.cache.num_cached_blocks == 4
    assert b.cache.evictable_blocks == 0  # under the save: not evictable, not counted as free
    assert b.load().kv_cached_tokens == 0 and b.kv.num_available_blocks == 11
    b.check_invariants()
    b.transfers_done([], ["saved"])
    b.check_invariants()
    assert b.pool.num_used == 4 and b.cache.evictable_blocks == 4  # the save landed: cached, idle
