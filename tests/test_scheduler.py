"""Scheduler: token budget, KV capacity, completion, preemption/resumption and prefix hits."""

from __future__ import annotations

import random

import pytest
from conftest import EchoExecutor, make_request

from kvbalance.engine import Instance
from kvbalance.request import RequestState
from kvbalance.scheduler import SchedulerConfig
from kvbalance.sim import simulate_instance


def _run(requests, *, num_blocks=64, block_size=4, policy="sarathi", budget=32, max_seqs=8, prefix=True):
    ex = EchoExecutor()
    inst = Instance(
        ex,
        num_blocks=num_blocks,
        block_size=block_size,
        scheduler_config=SchedulerConfig(
            policy=policy, max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_prefix_caching=prefix
        ),
    )
    run = simulate_instance(inst, requests, check_invariants=True)
    return inst, ex, run


def _random_requests(n, seed=0, shared=False):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.randint(1, 40)
        prompt = ([7] * 12 if shared and i % 2 else []) + [i * 1000 + j for j in range(plen)]
        reqs.append(
            make_request(f"r{i}", prompt, max_tokens=rng.randint(1, 20), arrival_s=rng.random() * 0.2)
        )
    return reqs


@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
@pytest.mark.parametrize("prefix", [True, False])
def test_every_request_finishes_within_budget_and_capacity(policy, prefix):
    reqs = _random_requests(40, shared=True)
    inst, ex, run = _run(reqs, policy=policy, prefix=prefix, budget=64 if policy == "vllm" else 32)
    assert not run.unfinished
    for r in reqs:
        assert r.state is RequestState.FINISHED
        assert r.num_output_tokens == r.max_tokens
    for plan in ex.plans:
        if policy == "sarathi":
            assert plan.num_tokens <= 32
        assert len(plan.seqs) <= 8
        assert len({s.request.request_id for s in plan.seqs}) == len(plan.seqs)
    assert inst.pool.num_used == (inst.cache.num_cached_blocks if prefix else 0)


def test_sarathi_puts_decodes_before_prefill_chunks():
    reqs = [make_request("a", 10, max_tokens=6), make_request("b", 100, max_tokens=2, arrival_s=0.015)]
    inst, ex, run = _run(reqs, num_blocks=64, budget=16)
    mixed = [
        p for p in ex.plans if any(s.is_prefill for s in p.seqs) and any(not s.is_prefill for s in p.seqs)
    ]
    assert mixed, "a long prompt should be chunked alongside running decodes"
    for plan in mixed:
        kinds = [s.is_prefill for s in plan.seqs]
        assert kinds == sorted(kinds)  # decodes (False) first
        assert plan.num_tokens <= 16


def test_vllm_policy_runs_prefill_only_steps():
    reqs = _random_requests(20)
    inst, ex, run = _run(reqs, policy="vllm", budget=64)
    for plan in ex.plans:
        kinds = {s.is_prefill for s in plan.seqs}
        assert len(kinds) == 1
        for s in plan.seqs:
            if s.is_prefill:
                assert s.start == s.request.num_cached_tokens and s.sample  # whole prompts, never chunked


def test_preemption_and_resumption_keep_outputs():
    reqs = [make_request(f"r{i}", 20, max_tokens=30, arrival_s=0.0) for i in range(6)]
    ref = [make_request(f"r{i}", 20, max_tokens=30, arrival_s=0.0) for i in range(6)]
    inst, _, _ = _run(reqs, num_blocks=40, budget=64)  # 6 x 50 tokens cannot all fit in 160 slots
    assert inst.scheduler.num_preemptions > 0
    assert any(r.num_preemptions for r in reqs)
    _run(ref, num_blocks=1000, budget=64)
    for a, b in zip(reqs, ref):
        assert a.num_output_tokens == 30
        assert a.output_token_ids == b.output_token_ids


def test_prefix_hit_skips_recompute():
    shared = list(range(100, 132))  # 8 full blocks of 4
    a = make_request("a", shared + [1, 2], max_tokens=2)
    b = make_request("b", shared + [3, 4, 5], max_tokens=2, arrival_s=1.0)
    inst, ex, _ = _run([a, b], budget=64)
    first_b = next(s for p in ex.plans for s in p.seqs if s.request is b)
    assert b.num_cached_tokens == 32 and first_b.start == 32 and first_b.num_new_tokens == 3
    assert inst.scheduler.prefix_hit_tokens == 32


def test_full_prompt_hit_still_computes_last_token():
    a = make_request("a", list(range(16)), max_tokens=1)
    b = make_request("b", list(range(16)), max_tokens=1, arrival_s=1.0)
    inst, ex, _ = _run([a, b], budget=64)
    first_b = next(s for p in ex.plans for s in p.seqs if s.request is b)
    assert first_b.start == 12 and first_b.num_new_tokens == 4 and first_b.sample


def test_concurrent_identical_prefixes_are_cached_once_and_tables_stay_append_only():
    # three requests compute the same 64-token prefix in one step: the cache keeps one copy of each
    # block, and no request's block table ever changes a block id it already had (an in-flight KV save
    # could be reading it)
    reqs = [make_request(f"r{i}", list(range(64)) + [i], max_tokens=4) for i in range(3)]
    seen: dict[str, list[int]] = {}

    class Recording(EchoExecutor):
        def execute(self, plan):
            for s in plan.seqs:
                table = list(s.request.block_ids)
                before = seen.get(s.request.request_id, [])
                assert table[: len(before)] == before, "a block id changed in a block table"
                seen[s.request.request_id] = table
            return super().execute(plan)

    inst = Instance(
        Recording(),
        num_blocks=128,
        block_size=4,
        scheduler_config=SchedulerConfig(max_num_batched_tokens=256),
    )
    run = simulate_instance(inst, reqs, check_invariants=True)
    assert not run.unfinished
    assert inst.cache.num_cached_blocks == 16 + 3  # the shared prefix once, plus each request's own tail
    assert inst.pool.num_used == inst.cache.num_cached_blocks  # the duplicates went with their requests
    # a later request with the same prefix hits all of it
    late = make_request("late", list(range(64)) + [9], max_tokens=2)
    simulate_instance(inst, [late], check_invariants=True)
    assert late.prefix_hit_tokens == 64


def test_impossible_request_is_rejected_with_reason():
    big = make_request("big", 300, max_tokens=10)
    ok = make_request("ok", 10, max_tokens=2)
    inst, _, run = _run([big, ok], num_blocks=16)
    assert big.state is RequestState.REJECTED and big.reject_reason.startswith("kv_capacity")
    assert ok.state is RequestState.FINISHED and not run.unfinished


def test_bad_config_names_field():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="fifo")
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


# -- admission and rejection agree (issue 7) ---------------------------------------------------------


@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_request_that_fits_the_pool_but_not_the_watermark_is_still_served(policy):
    # 100 blocks of 16 tokens, 1% watermark = 1 block: a 1590 + 4 token request needs all 100 blocks
    reqs = [make_request(f"w{i}", 1590, max_tokens=4, arrival_s=float(i)) for i in range(3)]
    inst = Instance(
        EchoExecutor(),
        num_blocks=100,
        block_size=16,
        scheduler_config=SchedulerConfig(policy=policy, max_num_batched_tokens=2048),
    )
    run = simulate_instance(inst, reqs, check_invariants=True)
    assert not run.unfinished
    assert all(r.state is RequestState.FINISHED and r.num_output_tokens == 4 for r in reqs)


def test_watermark_keeps_blocks_free_while_others_run():
    # 20 blocks of 4 tokens, watermark 10% = 2 blocks. "a" holds 10 blocks; "b" needs 9 for its prompt:
    # 9 + 2 > 10 free, so "b" waits until "a" finishes (without a watermark it would be admitted at once).
    cfg = SchedulerConfig(max_num_batched_tokens=64, watermark=0.1)
    inst = Instance(EchoExecutor(), num_blocks=20, block_size=4, scheduler_config=cfg)
    a, b = make_request("a", 40, max_tokens=3), make_request("b", 36, max_tokens=3, arrival_s=0.001)
    run = simulate_instance(inst, [a, b], check_invariants=True)
    assert not run.unfinished
    assert b.first_scheduled_s >= a.finish_s
    assert inst.scheduler.num_preemptions == 0


def test_request_exactly_at_capacity_is_served_and_one_token_more_is_rejected():
    # 8 blocks of 4 tokens = 32 KV tokens; a request's KV peaks at prompt + max_tokens - 1 tokens
    def run(prompt, out):
        inst = Instance(EchoExecutor(), num_blocks=8, block_size=4)
        req = make_request("edge", prompt, max_tokens=out)
        return simulate_instance(inst, [req], check_invariants=True), req

    run_ok, ok = run(29, 4)  # 32 tokens of KV: fits exactly
    assert ok.state is RequestState.FINISHED and ok.num_output_tokens == 4
    run_no, no = run(30, 4)  # 33 tokens: can never fit
    assert no.state is RequestState.REJECTED and "kv_capacity" in no.reject_reason
    assert not run_no.unfinished and run_ok.num_steps > 0
