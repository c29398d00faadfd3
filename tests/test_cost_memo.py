"""CostModel.step memoises the operators that depend on the step's token count alone (and the LM head per
sampled count) and replays their float additions in the operator loop's order: every field of the breakdown is
the operator-by-operator loop's (CostModel._step_plain) to the last bit, on serial and overlapped engines, at
every TP degree, on GPUs with measured shape corrections and without, memo hit or miss."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvbalance.perf import cost as cost_module
from kvbalance.perf.cost import CostModel


def bits(b) -> tuple[str, ...]:
    """A breakdown's fields as exact hex floats (== would call 0.0 and -0.0 equal)."""
    return tuple(float(x).hex() for x in dataclasses.astuple(b))


def random_steps(rng: random.Random, n: int) -> list[list[tuple[int, int, bool]]]:
    """Decode batches, prompt chunks and mixes; token counts repeat (memo hits) and include the tiny ones
    that take the element-wise kernels' small-token path."""
    out = []
    for _ in range(n):
        kind = rng.random()
        decodes = [(1, rng.randint(1, 4000), rng.random() < 0.97) for _ in range(rng.randint(1, 48))]
        if kind < 0.1:
            decodes = decodes[: rng.randint(1, 3)]
        chunks = []
        if kind > 0.6:
            for _ in range(rng.randint(1, 2)):
                m = rng.choice((2, 7, 16, 17, 128, 256, 511, 512, rng.randint(2, 2048)))
                chunks.append((m, m + rng.randint(0, 2500), rng.random() < 0.5))
        seqs = (decodes if kind < 0.9 else []) + chunks
        rng.shuffle(seqs)
        out.append(seqs or [(1, 1, True)])
    return out


CASES = [
    ("llama-2-7b", "a100-80gb", 1, "vllm-v0"),  # serial engine, physical model only
    ("llama-2-70b", "a100-80gb", 4, "vllm-v1"),  # Vidur's set-up: overlapped engine, TP all-reduces
    ("llama-2-70b", "h100-sxm", 4, "vllm-v0"),  # measured shape corrections, serial
    ("llama-2-7b", "h100-sxm", 1, "vllm-v1"),  # corrections, overlapped
    ("llama-2-13b", "h100-sxm", 2, "sglang"),
    ("opt-13b", "a40", 2, "vllm-v0.6"),  # LayerNorm, biases, no rotary; the A40's own corrections
    ("qwen2.5-7b", "a40", 1, "vllm-v1"),  # QKV bias
]


@pytest.mark.parametrize("model, gpu, tp, engine", CASES)
def test_memoised_step_is_the_operator_loop_bit_for_bit(model, gpu, tp, engine):
    memo = CostModel(model, gpu, tp, engine=engine)
    plain = CostModel(model, gpu, tp, engine=engine)
    plain._step_memo = None  # every step through the operator loop
    steps = random_steps(random.Random(f"{model}{gpu}{tp}{engine}"), 300)
    for seqs in steps + steps[::-1]:  # the second pass is all memo hits
        assert bits(memo.step(seqs)) == bits(plain.step(seqs)) == bits(memo._step_plain(seqs)), seqs
    tokens = {sum(n for n, _, _ in s) for s in steps}
    assert len(memo._step_memo) == len(tokens) < len(steps)  # one entry per token count, reused


def test_the_memo_is_bounded_and_starts_over_with_the_same_answers(monkeypatch):
    monkeypatch.setattr(cost_module, "STEP_MEMO_MAX", 5)
    memo = CostModel("llama-2-70b", "h100-sxm", 4)
    plain = CostModel("llama-2-70b", "h100-sxm", 4)
    plain._step_memo = None
    for seqs in random_steps(random.Random(3), 200):
        assert bits(memo.step(seqs)) == bits(plain.step(seqs))
        assert len(memo._step_memo) <= 5 and len(memo._lm_memo) <= 5


def test_bad_steps_are_refused_as_before():
    cm = CostModel("llama-2-7b", "a100-80gb")
    with pytest.raises(ValueError, match="num_new_tokens: must be >= 1, got 0"):
        cm.step([(1, 10, True), (0, 10, True)])
    with pytest.raises(ValueError, match="context_len: 3 is smaller than num_new_tokens 4"):
        cm.step([(4, 3, True)])
    assert bits(cm.step([])) == bits(cm._step_plain([]))
