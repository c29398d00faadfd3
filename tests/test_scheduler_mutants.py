"""Scheduler behaviour pinned step by step (exact plans): the preemption victim, chunk shrinking, budgets.

Each test drives :class:`Scheduler` directly over a small :class:`BlockPool`, so every plan, block count and
preemption is known in advance; these are the cases mutation testing found unguarded (issue 7, item 5).
"""

from __future__ import annotations

import pytest
from conftest import make_request

from kvbalance.batch import StepResult
from kvbalance.kvcache.blocks import BlockPool
from kvbalance.request import RequestState
from kvbalance.scheduler import Scheduler, SchedulerConfig


def _scheduler(num_blocks: int, *, budget: int = 64, policy: str = "sarathi", watermark: float = 0.0, **kw):
    cfg = SchedulerConfig(policy=policy, max_num_batched_tokens=budget, watermark=watermark, **kw)
    return Scheduler(cfg, BlockPool(num_blocks, 4))


def _step(sched: Scheduler, now: float = 0.0, *, check: bool = True):
    """Plan, 'execute' (token = context length) and apply one step; return the plan's (id, start, n, sample)."""
    plan = sched.schedule(now)
    sampled = {s.request.request_id: 100 + s.context_len for s in plan.seqs if s.sample}
    sched.update(plan, StepResult(0.01, sampled), now)
    if check:
        sched.check_invariants()
    return [(s.request.request_id, s.start, s.num_new_tokens, s.sample) for s in plan.seqs]


def test_newest_running_request_is_preempted_not_the_oldest():
    # three 4-token prompts fill three of four blocks; each decode then needs a second block
    sched = _scheduler(4)
    reqs = [make_request(rid, 4, max_tokens=10) for rid in ("a", "b", "c")]
    for r in reqs:
        sched.add(r)
    assert _step(sched) == [("a", 0, 4, True), ("b", 0, 4, True), ("c", 0, 4, True)]
    # a takes the last free block; b can only grow by preempting the newest request, c
    assert _step(sched) == [("a", 4, 1, True), ("b", 4, 1, True)]
    a, b, c = reqs
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 0, 1)
    assert c.state is RequestState.WAITING and list(sched.waiting) == [c]
    assert c.num_computed_tokens == 0 and c.block_ids == []
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert sched.num_preemptions == 1


def test_request_that_cannot_grow_and_is_newest_preempts_itself():
    # a and b still have room in their first block; c (newest) needs a second one and none is free
    sched = _scheduler(3)
    a, b = make_request("a", 3, max_tokens=5), make_request("b", 3, max_tokens=5)
    c = make_request("c", 4, max_tokens=5)
    for r in (a, b, c):
        sched.add(r)
    _step(sched)
    assert _step(sched) == [("a", 3, 1, True), ("b", 3, 1, True)]
    assert c.state is RequestState.WAITING and c.num_preemptions == 1
    # c's block went back (its full prompt block stays cached, evictable); a and b keep one block each
    assert sched.kv.num_available_blocks == 1 and sched.cache.evictable_blocks == 1


def test_prefill_chunk_shrinks_to_the_free_blocks_instead_of_preempting():
    sched = _scheduler(8, budget=16)
    a = make_request("a", 32, max_tokens=2)
    sched.add(a)
    assert _step(sched) == [("a", 0, 16, False)]
    stolen = sched.pool.allocate(2)  # someone else holds 2 blocks: 2 of a's 4 more are free
    assert _step(sched, check=False) == [("a", 16, 8, False)]  # shrunk from 16 to the 8 tokens that fit
    assert len(a.block_ids) == 6 and sched.pool.num_free == 0
    assert sched.num_preemptions == 0 and a.state is RequestState.RUNNING
    sched.pool.free(stolen)
    assert _step(sched) == [("a", 24, 8, True)]


def test_chunk_shrinks_to_a_single_token_when_one_slot_is_left():
    # a 15-token chunk leaves one slot in the fourth block; with no block free the next chunk is 1 token
    sched = _scheduler(4, budget=15)
    a = make_request("a", 17, max_tokens=2)  # 2 prompt tokens left after the first chunk
    sched.add(a)
    assert _step(sched) == [("a", 0, 15, False)]
    assert _step(sched) == [("a", 15, 1, False)]
    assert sched.num_preemptions == 0 and a.state is RequestState.RUNNING


def test_decode_that_cannot_grow_is_not_shrunk_but_preempts():
    # a decode needs one new block; shrinking does not apply (n == 1): the newest request is preempted
    sched = _scheduler(2)
    a, b = make_request("a", 4, max_tokens=4), make_request("b", 4, max_tokens=4)
    sched.add(a)
    sched.add(b)
    _step(sched)
    assert _step(sched) == [("a", 4, 1, True)]
    assert b.state is RequestState.WAITING and b.num_preemptions == 1


@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_preempted_requests_resume_by_recompute_after_a_prefix_hit(policy):
    sched = _scheduler(4, policy=policy)
    reqs = [make_request(rid, 4, max_tokens=6) for rid in ("a", "b", "c")]
    for r in reqs:
        sched.add(r)
    plans = []
    while sched.has_work():
        plans.append(_step(sched, float(len(plans))))
    assert plans == [
        [("a", 0, 4, True), ("b", 0, 4, True), ("c", 0, 4, True)],
        [("a", 4, 1, True), ("b", 4, 1, True)],  # c preempted (newest)
        [("a", 5, 1, True), ("b", 5, 1, True)],
        [("a", 6, 1, True), ("b", 6, 1, True)],
        [("a", 7, 1, True), ("b", 7, 1, True)],
        [("a", 8, 1, True)],  # a needs a third block: b (now the newest) is preempted
        # b resumes: its prompt block is a prefix hit, the 4 tokens it had sampled + 1 are recomputed
        [("b", 4, 5, True)],
        # c's cached block was evicted to make room: prompt + its one sampled token recomputed
        [("c", 0, 5, True)],
        [("c", 5, 1, True)],
        [("c", 6, 1, True)],
        [("c", 7, 1, True)],
        [("c", 8, 1, True)],
    ]
    a, b, c = reqs
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 1)
    assert sched.num_preemptions == 2 and sched.prefix_hit_tokens == 4
    # the executor's token is 100 + context: the same outputs whether or not a request was preempted
    for r in reqs:
        assert r.state is RequestState.FINISHED and r.output_token_ids == [100 + n for n in range(4, 10)]
    assert sched.pool.num_used == sched.cache.num_cached_blocks


def test_vllm_policy_admits_nothing_while_admission_is_closed():
    sched = _scheduler(16, policy="vllm", budget=64)
    a = make_request("a", 4, max_tokens=4)
    sched.add(a)
    _step(sched)
    sched.add(make_request("b", 4, max_tokens=4))
    sched.admission_open = False  # the elastic reserve is lent: decodes only
    assert _step(sched) == [("a", 4, 1, True)]
    assert sched.num_waiting == 1
    sched.admission_open = True
    assert _step(sched) == [("b", 0, 4, True)]  # prefill-first: a waits for b's whole prompt


@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_sarathi_and_vllm_admit_nothing_while_admission_is_closed_even_with_nothing_running(policy):
    sched = _scheduler(16, policy=policy)
    sched.add(make_request("a", 4))
    sched.admission_open = False
    assert _step(sched) == [] and sched.num_waiting == 1


def test_vllm_admits_whole_prompts_and_a_prompt_over_the_budget_waits_for_the_next_step():
    sched = _scheduler(64, policy="vllm", budget=10)
    for rid, n in (("a", 6), ("b", 6), ("c", 12)):
        sched.add(make_request(rid, n, max_tokens=2))
    assert _step(sched) == [("a", 0, 6, True)]  # b does not fit the rest of the budget (4): never chunked
    assert _step(sched) == [("b", 0, 6, True)]
    assert _step(sched) == [("c", 0, 12, True)]  # alone, a prompt over the budget still runs whole
    assert _step(sched) == [("a", 6, 1, True), ("b", 6, 1, True), ("c", 12, 1, True)]


def test_sarathi_chunks_the_head_prompt_to_the_budget_left():
    sched = _scheduler(64, budget=10)
    sched.add(make_request("a", 6, max_tokens=3))
    sched.add(make_request("b", 9, max_tokens=3))
    assert _step(sched) == [("a", 0, 6, True), ("b", 0, 4, False)]
    assert _step(sched) == [("a", 6, 1, True), ("b", 4, 5, True)]
    assert _step(sched) == [("a", 7, 1, True), ("b", 9, 1, True)]


def test_max_num_seqs_caps_the_running_set():
    sched = _scheduler(64, max_num_seqs=2)
    for rid in "abc":
        sched.add(make_request(rid, 4, max_tokens=2))
    assert _step(sched) == [("a", 0, 4, True), ("b", 0, 4, True)]
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert _step(sched) == [("a", 4, 1, True), ("b", 4, 1, True)]  # both finish (2 tokens)
    assert _step(sched) == [("c", 0, 4, True)]


def test_stop_reasons_stop_token_eos_and_length():
    sched = _scheduler(64)
    stop = make_request("stop", 4, max_tokens=10)
    stop.sampling.stop_token_ids = [105]  # the executor's second token (context 5)
    eos = make_request("eos", 4, max_tokens=10)
    eos.sampling.ignore_eos = False
    eos.eos_token_id = 106
    ignored = make_request("ignored", 4, max_tokens=3)
    ignored.eos_token_id = 104  # ignore_eos: the eos id does not stop it
    for r in (stop, eos, ignored):
        sched.add(r)
    for i in range(10):
        if sched.has_work():
            _step(sched, float(i))
    assert (stop.finish_reason, stop.output_token_ids) == ("stop", [104, 105])
    assert (eos.finish_reason, eos.output_token_ids) == ("stop", [104, 105, 106])
    assert (ignored.finish_reason, ignored.output_token_ids) == ("length", [104, 105, 106])
    assert stop.finish_s == 1.0 and eos.finish_s == 2.0 and ignored.finish_s == 2.0
    assert eos.first_scheduled_s == 0.0 and eos.first_token_s == 0.0 and eos.token_times_s == [0.0, 1.0, 2.0]
    assert all(r.state is RequestState.FINISHED for r in (stop, eos, ignored))
    assert sched.num_running == 0 and sched.kv_used_tokens == 0


def test_counters_of_admitted_and_prefix_hit_tokens():
    sched = _scheduler(64)
    a = make_request("a", list(range(10)), max_tokens=1)
    sched.add(a)
    _step(sched)
    b = make_request("b", list(range(9)), max_tokens=1)  # 2 full cached blocks of a
    sched.add(b)
    assert _step(sched, 1.0) == [("b", 8, 1, True)]
    assert (b.num_cached_tokens, b.prefix_hit_tokens, b.first_scheduled_s) == (8, 8, 1.0)
    assert (sched.admitted_tokens, sched.prefix_hit_tokens, sched.external_hit_tokens) == (19, 8, 0)


def test_first_scheduled_time_survives_preemption():
    sched = _scheduler(2)
    a, b = make_request("a", 4, max_tokens=4), make_request("b", 4, max_tokens=4)
    sched.add(a)
    sched.add(b)
    now = 0.0
    while sched.has_work():
        _step(sched, now)
        now += 1.0
    assert b.num_preemptions == 1 and b.first_scheduled_s == 0.0 and b.first_token_s == 0.0


def test_has_prefill_work_counts_waiting_mid_prompt_and_recompute():
    sched = _scheduler(64, budget=4)
    assert not sched.has_prefill_work()
    a = make_request("a", 5, max_tokens=3)
    sched.add(a)
    assert sched.has_prefill_work()  # waiting
    _step(sched)  # 4 of 5 prompt tokens
    assert sched.has_prefill_work()  # a one-token last prompt chunk is still prefill
    _step(sched)
    assert a.num_computed_tokens == 5 and not sched.has_prefill_work()  # decoding only
    _step(sched)
    assert (a.num_computed_tokens, len(a.output_token_ids)) == (6, 2) and not sched.has_prefill_work()
    a.num_computed_tokens = 5  # two tokens to compute past the prompt (a recompute): prefill work
    assert sched.has_prefill_work()


def test_preempt_from_outside_frees_blocks_and_requeues_first():
    sched = _scheduler(16)
    a, b = make_request("a", 8, max_tokens=4), make_request("b", 4, max_tokens=4)
    sched.add(a)
    _step(sched)
    sched.add(b)
    sched.preempt(a)
    assert a.state is RequestState.WAITING and list(sched.waiting) == [a, b]
    assert a.block_ids == [] and a.num_computed_tokens == 0 and sched.num_preemptions == 1
    with pytest.raises(ValueError, match=r"^req: a is waiting, not running$"):
        sched.preempt(a)
    sched.check_invariants()


def test_abort_ends_a_request_wherever_it_is():
    sched = _scheduler(16)
    run, wait = make_request("run", 8, max_tokens=4), make_request("wait", 4, max_tokens=4)
    sched.add(run)
    _step(sched)
    sched.add(wait)
    sched.abort(run, 2.0)
    sched.abort(wait, 3.0)
    for r, t in ((run, 2.0), (wait, 3.0)):
        assert (r.state, r.finish_reason, r.finish_s, r.block_ids) == (RequestState.ABORTED, "abort", t, [])
    assert not sched.has_work() and sched.kv_used_tokens == 0
    sched.abort(run, 9.0)  # already over: nothing changes
    assert run.finish_s == 2.0
    sched.check_invariants()


def test_policy_token_budgets():
    from kvbalance.scheduler.base import POLICIES

    assert POLICIES.get("sarathi").token_budget(512, 4096) == 512
    assert POLICIES.get("vllm").token_budget(512, 4096) == 4096  # a whole prompt always fits a step
    assert POLICIES.get("vllm").token_budget(8192, 4096) == 8192


def test_decodes_go_first_and_the_budget_stops_the_step_exactly():
    sched = _scheduler(64, budget=16)
    reqs = [make_request(rid, 4, max_tokens=10) for rid in "abcd"]
    for r in reqs:
        sched.add(r)
    _step(sched)
    _step(sched)
    reqs[0].num_computed_tokens -= 2  # a (the oldest) has 3 tokens to recompute: prefill work
    sched.config.max_num_batched_tokens = 3
    assert _step(sched, check=False) == [("b", 5, 1, True), ("c", 5, 1, True), ("d", 5, 1, True)]
    sched.config.max_num_batched_tokens = 5
    assert _step(sched) == [("b", 6, 1, True), ("c", 6, 1, True), ("d", 6, 1, True), ("a", 3, 2, False)]


def test_a_decode_that_preempts_itself_leaves_the_older_prefill_scheduled():
    sched = _scheduler(3)
    a, b = make_request("a", 4, max_tokens=10), make_request("b", 3, max_tokens=10)
    sched.add(a)
    sched.add(b)
    _step(sched)
    _step(sched)  # a takes the last free block; b's next decode needs one more
    a.num_computed_tokens = 3  # a recomputes 3 tokens inside its own blocks
    assert _step(sched, check=False) == [("a", 3, 3, True)]
    assert b.state is RequestState.WAITING and b.num_preemptions == 1


def test_logprobs_are_kept_only_when_asked_for_and_reported():
    sched = _scheduler(16)
    want, plain = make_request("want", 4, max_tokens=2), make_request("plain", 4, max_tokens=2)
    want.sampling.logprobs = 1
    sched.add(want)
    sched.add(plain)
    plan = sched.schedule(0.0)
    lp = {"want": "lp-want", "plain": "lp-plain"}
    sched.update(plan, StepResult(0.01, {"want": 7, "plain": 7}, lp), 0.0)
    assert want.output_logprobs == ["lp-want"] and plain.output_logprobs == []
    plan = sched.schedule(1.0)
    sched.update(plan, StepResult(0.01, {"want": 8, "plain": 8}, {}), 1.0)  # none reported this step
    assert want.output_logprobs == ["lp-want"]
