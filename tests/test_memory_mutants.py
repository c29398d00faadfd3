"""perf/memory.py on a tiny model, every term by hand (milliseconds each).

Activation reserve (the Elastic KV Cache paper's quantity, vLLM's profiling peak): with C = chunk, h = hidden,
H/K = query/KV heads per rank (rounded up), d = head_dim, I = intermediate per rank, V = vocab, e = dtype bytes
and n = min(sampled rows, C): resident 2 C h e + max(attn C e [(H + 2K)d + (H + K)d + H d + h],
mlp C e [3 I + h], sampler n V (e + 8)). KV capacity = floor((M util - weights / tp - reserve) / kv bytes).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest

from kvbalance.perf.memory import (
    activation_reserve_bytes,
    engine_activation_reserve_bytes,
    kv_capacity_tokens,
    kv_pool_bytes,
    lendable_kv_tokens,
    reserve_share_of_kv,
)
from kvbalance.specs import ModelSpec, get_gpu

# h = 64, H = 8, K = 2, d = 16, I = 32, V = 10, e = 2; 3 layers: 384 KV bytes per token (192 at tp = 2)
TINY = ModelSpec(
    name="tiny",
    num_layers=3,
    hidden_size=64,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=32,
    vocab_size=10,
    max_context=64,
)


def test_activation_reserve_attention_bound_by_hand():
    # C = 4: resident 2*4*64*2 = 1024; attn 4*2*(12*16 + 10*16 + 8*16 + 64) = 4352; mlp 8*(96 + 64) = 1280
    assert activation_reserve_bytes(TINY, 4) == 1024 + 4352
    # tp = 2: H = 4, K = 1, I = 16: attn 8*(6*16 + 5*16 + 4*16 + 64) = 2432
    assert activation_reserve_bytes(TINY, 4, 2) == 1024 + 2432
    # tp = 4: H = 2, K = ceil(2/4) = 1 (replicated): attn 8*(4*16 + 3*16 + 2*16 + 64) = 1664
    assert activation_reserve_bytes(TINY, 4, 4) == 1024 + 1664
    assert activation_reserve_bytes(TINY) == activation_reserve_bytes(TINY, 8192)


def test_activation_reserve_mlp_and_sampler_bound_by_hand():
    wide = dataclasses.replace(TINY, intermediate_size=4096)
    # mlp 4*2*(3*4096 + 64) = 98816 beats attn 4352 and the sampler 4*10*10 = 400
    assert activation_reserve_bytes(wide, 4) == 1024 + 98816
    big_vocab = dataclasses.replace(TINY, vocab_size=100_000)
    # sampler: n = min(3, 4) rows of V x (2 + 2 x 4) bytes
    assert activation_reserve_bytes(big_vocab, 4, num_sampled_tokens=3) == 1024 + 3 * 100_000 * 10
    assert activation_reserve_bytes(big_vocab, 4, num_sampled_tokens=99) == 1024 + 4 * 100_000 * 10  # n <= C
    assert activation_reserve_bytes(big_vocab, 4, num_sampled_tokens=0) == 1024 + 4352  # no sampling
    with pytest.raises(ValueError, match="^num_sampled_tokens must be non-negative, got -1$"):
        activation_reserve_bytes(TINY, 4, num_sampled_tokens=-1)


def test_engine_reserve_samples_min_of_seqs_and_budget():
    big_vocab = dataclasses.replace(TINY, vocab_size=100_000)
    assert engine_activation_reserve_bytes(big_vocab, 2, 16, 4) == 2 * 16 * 64 * 2 + 4 * 100_000 * 10
    assert engine_activation_reserve_bytes(big_vocab, 1, 16, 64) == 2 * 16 * 64 * 2 + 16 * 100_000 * 10
    d = engine_activation_reserve_bytes(big_vocab)  # tp 1, 8192 tokens, 256 sequences
    assert d == 2 * 8192 * 64 * 2 + 256 * 100_000 * 10
    assert engine_activation_reserve_bytes(TINY, 2) == activation_reserve_bytes(TINY, 8192, 2)
    assert (
        engine_activation_reserve_bytes(TINY) == 2 * 8192 * 64 * 2 + 8192 * 2 * 544
    )  # tp 1: attention-bound


def _gpu(capacity_bytes: int):
    return dataclasses.replace(get_gpu("a100-80gb"), mem_capacity_bytes=capacity_bytes)


def test_kv_capacity_tokens_by_hand():
    w = TINY.weight_bytes
    gpu = _gpu(10**8)
    assert kv_capacity_tokens(TINY, gpu, 1, 0.5, 1000) == (5 * 10**7 - w - 1000) // 384
    assert kv_capacity_tokens(TINY, gpu, 2, 1.0, 0) == int((10**8 - w / 2) // 192)
    assert kv_capacity_tokens(TINY, gpu, 1, 1.0, 0) == (10**8 - w) // 384  # utilisation 1 is allowed
    # default reserve: the engine's, at this tp
    r2 = engine_activation_reserve_bytes(TINY, 2)
    assert kv_capacity_tokens(TINY, gpu, 2) == int((10**8 * 0.9 - w / 2 - r2) // 192)
    # 1 byte left: no whole token, but not an error; 0 bytes left: an error
    assert kv_capacity_tokens(TINY, _gpu(w + 1), 1, 1.0, 0) == 0
    with pytest.raises(ValueError, match="^tp: tiny needs"):
        kv_capacity_tokens(TINY, _gpu(w + 1000), 1, 1.0, 1000)


def test_kv_capacity_counts_whole_tokens_of_the_free_bytes_exactly():
    # free = 2^61 + 101 - weights bytes: the float quotient free / 384 rounds up to the next integer, the
    # whole-token count must not
    gpu = _gpu(2305843009213694949)
    free = 2305843009213694949 * 1.0 - TINY.weight_bytes
    assert kv_capacity_tokens(TINY, gpu, 1, 1.0, 0) == math.floor(Fraction(free) / 384) == 6004799503160238


def test_kv_capacity_errors():
    gpu = _gpu(10**8)
    for util in (0, 1.5):
        with pytest.raises(ValueError, match=f"^gpu_memory_utilization: must be in \\(0, 1\\], got {util}$"):
            kv_capacity_tokens(TINY, gpu, 1, util)
    with pytest.raises(ValueError, match="^activation_reserve_bytes: must be >= 0, got -1$"):
        kv_capacity_tokens(TINY, gpu, 1, 0.9, -1)
    gib = 1 << 30
    small = _gpu(3 * gib)
    weights = TINY.weight_bytes
    msg = (
        f"tp: tiny needs {weights / gib:.1f} GiB of weights per GPU at tp=1 plus {2.0:.1f} GiB activation "
        f"reserve, but a100-80gb offers {1.5:.1f} GiB at gpu_memory_utilization=0.5; raise tp or pick a bigger GPU"
    )
    with pytest.raises(ValueError) as err:
        kv_capacity_tokens(TINY, small, 1, 0.5, 2 * gib)
    assert str(err.value) == msg


def test_kv_pool_bytes_by_hand():
    assert kv_pool_bytes(1000, 100, 50) == 900 - 150  # utilisation 0.9 by default
    assert kv_pool_bytes(1000, 100, 50, 1.0, 25) == 1000 - 175
    assert kv_pool_bytes(1, 0, 0, 1.0) == 1
    assert kv_pool_bytes(1000, 0, 0, 1.0, 999) == 1
    with pytest.raises(
        ValueError, match="^no memory left for the KV pool: 1.0 x 1000 B minus weights 0 B, reserve"
    ):
        kv_pool_bytes(1000, 0, 0, 1.0, 1000)
    with pytest.raises(ValueError, match="^gpu_memory_bytes must be positive, got 0$"):
        kv_pool_bytes(0, 0, 0)
    for util in (0, 1.5):
        with pytest.raises(ValueError, match=f"^gpu_memory_utilization must lie in \\(0, 1\\], got {util}$"):
            kv_pool_bytes(1000, 0, 0, util)
    for i, name in enumerate(("weight_bytes", "reserve_bytes", "other_bytes")):
        args = [0, 0, 0]
        args[i] = -1
        with pytest.raises(ValueError, match=f"^{name} must be non-negative, got -1$"):
            kv_pool_bytes(1000, args[0], args[1], 0.9, args[2])


def test_reserve_share_and_lendable_tokens():
    assert reserve_share_of_kv(1000, 100, 50) == 50 / (50 + 750)
    assert reserve_share_of_kv(1000, 100, 50, 1.0, 25) == 50 / (50 + 825)
    assert lendable_kv_tokens(1000, TINY) == 1000 // 384
    assert lendable_kv_tokens(1000, TINY, 2) == 1000 // 192
    assert lendable_kv_tokens(0, TINY) == 0
    with pytest.raises(ValueError, match="^reserve_bytes must be non-negative, got -1$"):
        lendable_kv_tokens(-1, TINY)
