"""The simulator's shortcuts give what the long way gives, to the last bit: a plan's cost read straight from the
plan (``plan_tally``), a decode-only step from its two sums (``CostModel.decode_step``), block hashes taken
from the bytes the prefix cache keeps (``BlockHasher.token_bytes_hashes``), and the prefix cache's blocks and
hashes when ``cache_full_blocks`` publishes a prompt chunk by chunk and its output block by block."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from kvbalance.batch import BatchPlan, ScheduledSeq
from kvbalance.kvcache.blocks import BlockPool
from kvbalance.kvcache.hashing import HASH_ALGOS, BlockHasher, token_bytes
from kvbalance.kvcache.manager import KVCacheManager
from kvbalance.perf.cost import CostModel, plan_tally, tally
from kvbalance.request import Request, SamplingParams
from kvbalance.workloads.tokens import shared_prefix_prompt, unique_prompt


def bits(b) -> tuple[str, ...]:
    return tuple(float(x).hex() for x in dataclasses.astuple(b))


def random_plan(rng: random.Random) -> BatchPlan:
    plan = BatchPlan()
    req = Request("r", [1, 2, 3])
    for _ in range(rng.randint(1, 40)):
        if rng.random() < 0.8:
            plan.seqs.append(ScheduledSeq(req, rng.randint(0, 4000), 1, rng.random() < 0.97))
        else:
            plan.seqs.append(ScheduledSeq(req, rng.randint(0, 3000), rng.randint(2, 600), rng.random() < 0.5))
    return plan


@pytest.mark.parametrize(
    "model, gpu, tp, engine",
    [("llama-2-70b", "a100-80gb", 4, "vllm-v1"), ("llama-2-7b", "h100-sxm", 1, "vllm-v0")],
)
def test_plan_costs_read_from_the_plan_are_the_tuple_path_bit_for_bit(model, gpu, tp, engine):
    cm = CostModel(model, gpu, tp, engine=engine)
    rng = random.Random(7)
    for _ in range(300):
        plan = random_plan(rng)
        seqs = CostModel.plan_seqs(plan)
        assert plan_tally(plan) == tally(seqs)
        assert bits(cm.predict(plan)) == bits(cm.step(seqs)) == bits(cm._step_plain(seqs))
        n = rng.randint(1, 128)
        ctx = [rng.randint(1, 4000) for _ in range(n)]
        decodes = [(1, c, True) for c in ctx]
        assert bits(cm.decode_step(n, sum(ctx))) == bits(cm.step(decodes))


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_hashes_from_token_bytes_are_the_token_hashes(algo):
    hasher = BlockHasher(algo, salt="s")
    tokens = np.random.default_rng(0).integers(0, 1 << 40, 16 * 9)
    full = hasher.prefix_block_hashes(tokens, 16)
    for start in (0, 1, 3, 6):
        prev = full[start - 1] if start else 0
        got = hasher.token_bytes_hashes(token_bytes(tokens[start * 16 :]), 16, start, prev)
        assert got == full[start:]
    assert hasher.token_bytes_hashes(token_bytes(tokens[:15]), 16, 0, 0) == []


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_published_blocks_carry_the_whole_sequence_hashes(algo):
    """Chunks of a prompt and then output blocks, published as they fill: the request's hashes are the chained
    hashes of its whole token sequence, a second request with the same prefix hits it, and the cache checks."""
    kv = KVCacheManager(BlockPool(256, 16), True, BlockHasher(algo))
    prompt = shared_prefix_prompt(0, 160, 75, uid=1)
    req = Request("a", prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    hit = kv.get_computed_blocks(req)
    kv.admit(req, hit, req.num_tokens)
    for computed in (64, 128, req.num_prompt_tokens):
        req.num_computed_tokens = computed
        kv.cache_full_blocks(req)
    for k in range(40):  # decode: one token at a time, published when a block fills
        req.output_token_ids.append(10_000 + k)
        kv.allocate_slots(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens - 1
        kv.cache_full_blocks(req)
    all_tokens = req.token_ids(0, req.num_computed_tokens)
    assert kv.block_hashes(req, req.num_computed_tokens) == kv.hasher.prefix_block_hashes(all_tokens, 16)
    assert kv.num_cached_blocks_of(req) == req.num_computed_tokens // 16
    kv.check_invariants([req])
    other = Request("b", shared_prefix_prompt(0, 160, 40, uid=2), SamplingParams(max_tokens=4))
    assert kv.get_computed_blocks(other).num_blocks == 160 // 16
    assert kv.get_computed_blocks(Request("c", unique_prompt(3, 100))).num_blocks == 0
