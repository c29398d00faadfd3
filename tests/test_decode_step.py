"""The bf16 CPU decode step without the per-call glue (kvbalance/model/decode_step.py) computes the
general path's bits: same hidden states on all-decode steps, same tokens whatever the batch around a
request, and it stays out of the steps it does not cover."""

from __future__ import annotations

import pytest
import torch

from kvbalance.batch import BatchPlan, ScheduledSeq
from kvbalance.executor.torch import TorchExecutor
from kvbalance.model import decode_step, fused, llama, native
from kvbalance.model.weights import random_weights
from kvbalance.request import Request

BF16 = torch.bfloat16
BLOCK = 16
# SmolLM2's head dim (the native kernels' shapes), GQA group 2, sizes off the 16-lane vector width
CONFIG = llama.LlamaConfig(
    name="tiny-decode", vocab_size=256, hidden_size=72, intermediate_size=100, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=64, max_context=512,
)  # fmt: skip

pytestmark = pytest.mark.skipif(
    fused.library() is None
    or native.native_library(2, 64, BF16, BF16) is None
    or not llama.native_bf16_matmul(),
    reason="needs the fused and native kernels and native bf16 matmuls",
)


def _executor() -> TorchExecutor:
    return TorchExecutor(CONFIG, random_weights(CONFIG, seed=0), num_blocks=64, block_size=BLOCK, dtype=BF16)


def _requests(lens: list[int], max_tokens: int = 6) -> list[Request]:
    g = torch.Generator().manual_seed(3)
    return [
        Request(
            f"r{i}", torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist(), max_tokens=max_tokens
        )
        for i, n in enumerate(lens)
    ]


def _step(ex: TorchExecutor, reqs: list[Request], free: list[int]) -> dict[str, int]:
    """Every request computes its missing tokens (a prefill, or one decode) and samples."""
    seqs = []
    for r in reqs:
        n = r.num_tokens - r.num_computed_tokens
        while len(r.block_ids) * BLOCK < r.num_computed_tokens + n:
            r.block_ids.append(free.pop())
        seqs.append(ScheduledSeq(r, r.num_computed_tokens, n, True))
    result = ex.execute(BatchPlan(seqs, BLOCK))
    for s in seqs:
        s.request.num_computed_tokens += s.num_new_tokens
        s.request.output_token_ids.append(result.sampled[s.request.request_id])
    return result.sampled


def _decode_meta(ex: TorchExecutor, reqs: list[Request]):
    starts = [r.num_computed_tokens for r in reqs]
    ids = torch.tensor([r.output_token_ids[-1] for r in reqs])
    meta = llama.build_step_metadata(
        starts, [1] * len(reqs), [r.block_ids for r in reqs], list(range(len(reqs))), BLOCK,
        ex.model.layers[0].attn.group, "cpu", BF16,
    )  # fmt: skip
    return ids, meta


def test_decode_step_hidden_states_equal_the_layer_loop_bit_for_bit(monkeypatch):
    ex, free = _executor(), list(range(64))
    reqs = _requests([20, 37, 5, 64])  # contexts off and on block boundaries: masked and full blocks
    _step(ex, reqs, free)  # the prefill, through the general path
    for r in reqs:
        r.block_ids.append(free.pop())
    ids, meta = _decode_meta(ex, reqs)
    calls = []
    real = decode_step.run_layers
    monkeypatch.setattr(decode_step, "run_layers", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        fast = ex.model(ids, meta).clone()
        assert calls == [1]  # the step took the glue-free path
        h = ex.model.embed(ids)
        for layer in ex.model.layers:  # the module loop: checked wrappers, no residual fusion
            h = layer(h, meta)
    assert torch.equal(fast, h)


def test_tokens_do_not_depend_on_the_batch_or_earlier_steps_of_other_sizes():
    """Buffers are per step and shared by the layers only: a request's greedy tokens in a batch whose
    size changes step to step (4 -> 3 -> 2) equal those of a fresh executor running it alone."""
    lens = [20, 37, 5, 64]
    ex, free = _executor(), list(range(64))
    reqs = _requests(lens)
    batched = {r.request_id: [] for r in reqs}
    live = list(reqs)
    for step in range(6):
        for rid, tok in _step(ex, live, free).items():
            batched[rid].append(tok)
        if step in (1, 3):
            live = live[:-1]  # a request leaves: the next steps are smaller
    for i, r in enumerate(_requests(lens)):
        alone, free1 = _executor(), list(range(64))
        n = len(batched[r.request_id])
        got = [_step(alone, [r], free1)[r.request_id] for _ in range(n)]
        assert got == batched[r.request_id], f"request {i}"


def test_steps_with_a_prefill_or_other_dtypes_keep_the_general_path():
    ex, free = _executor(), list(range(64))
    reqs = _requests([20, 9])
    _step(ex, reqs[:1], free)
    reqs[0].block_ids.append(free.pop())
    reqs[1].block_ids.extend([free.pop(), free.pop()])
    meta = llama.build_step_metadata(
        [20, 0], [1, 9], [reqs[0].block_ids, reqs[1].block_ids], [0, 1], BLOCK, 2, "cpu", BF16
    )
    meta.cos = meta.sin = torch.zeros(10, 32, dtype=BF16)
    with torch.inference_mode():
        assert decode_step.decode_plan(ex.model, torch.zeros(10, 72, dtype=BF16), meta) is None  # mixed
        ids, dec = _decode_meta(ex, reqs[:1])
        dec.cos = dec.sin = torch.zeros(1, 32, dtype=BF16)
        assert decode_step.decode_plan(ex.model, torch.zeros(1, 72, dtype=BF16), dec) is not None
        assert decode_step.decode_plan(ex.model, torch.zeros(1, 72), dec) is None  # float32 activations
    assert decode_step.decode_plan(ex.model, torch.zeros(1, 72, dtype=BF16), dec) is None  # grad mode


def test_executor_keeps_the_decodes_one_group_for_the_paged_kernel(monkeypatch):
    """The paged kernel pads no context, so the executor does not split decodes by context length (that
    split is for SDPA over gathered blocks): an all-decode step with contexts from 5 to 200 is one group
    and takes the glue-free path, and its tokens equal those of the split step."""
    lens = [5, 8, 10, 12, 15, 20, 150, 160, 170, 180, 190, 200]  # _split_decodes cuts this in groups
    meta = llama.build_step_metadata(
        lens, [1] * len(lens), [list(range(i * 13, i * 13 + 13)) for i in range(len(lens))],
        list(range(len(lens))), BLOCK, 2, "cpu", BF16,
    )  # fmt: skip
    assert len(meta.groups) > 1
    tokens = {}
    for split in (False, True):
        ex = TorchExecutor(
            CONFIG, random_weights(CONFIG, seed=0), num_blocks=160, block_size=BLOCK, dtype=BF16
        )
        assert ex.split_decodes is False  # the native kernel applies to this model
        ex.split_decodes = split
        free, reqs = list(range(160)), _requests(lens)
        _step(ex, reqs, free)  # the prefills
        calls = []
        real = decode_step.run_layers
        monkeypatch.setattr(
            decode_step, "run_layers", lambda *a, real=real, calls=calls: calls.append(1) or real(*a)
        )
        tokens[split] = [_step(ex, reqs, free) for _ in range(3)]
        monkeypatch.setattr(decode_step, "run_layers", real)
        assert calls == ([] if split else [1, 1, 1])
    assert tokens[False] == tokens[True]
