"""Module migration on real tensors gives the single instance's greedy tokens, token for token.

Layer level: layers [0, k) on one executor, [k, L) on another after their weights and KV moved.
Attention level: some KV heads' context on a helper, partial attention merged by log-sum-exp. The
moved copies left behind are poisoned with NaN, so any read of them would change the tokens.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvbalance.batch import BatchPlan, ScheduledSeq  # noqa: E402
from kvbalance.executor.torch import TorchExecutor  # noqa: E402
from kvbalance.model.llama import LlamaConfig  # noqa: E402
from kvbalance.model.partial_attention import (  # noqa: E402
    AttentionSplit,
    HelperAttention,
    LayerSplit,
    merge_partial_attention,
    partial_attention,
)
from kvbalance.model.weights import random_weights  # noqa: E402
from kvbalance.request import Request  # noqa: E402

BLOCK = 8
NUM_OUT = 10
MIGRATE_AFTER = 3  # output tokens produced by the single instance before the move

TINY = LlamaConfig(
    name="tiny-migrate",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    max_context=512,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Blocks:
    def __init__(self, n: int) -> None:
        self.free = list(range(n))[::-1]  # handed out in reverse: block tables are never the identity

    def ensure(self, r: Request, upto: int) -> None:
        while len(r.block_ids) * BLOCK < upto:
            r.block_ids.append(self.free.pop(0))


def step(runner, reqs: list[Request], blocks: Blocks, logits: dict, chunk: int = 1 << 30) -> None:
    """One hand-built step (decodes first): each request computes min(chunk, missing) tokens."""
    seqs = []
    for r in reqs:
        n = min(r.num_tokens - r.num_computed_tokens, chunk)
        blocks.ensure(r, r.num_computed_tokens + n)
        seqs.append(ScheduledSeq(r, r.num_computed_tokens, n, r.num_computed_tokens + n == r.num_tokens))
    seqs.sort(key=lambda s: s.is_prefill)
    result = runner.execute(BatchPlan(seqs, BLOCK))
    ex = getattr(runner, "second", None) or getattr(runner, "home", None) or runner
    rows = {rid: i for i, rid in enumerate(ex.last_logits_request_ids)}
    for s in seqs:
        s.request.num_computed_tokens += s.num_new_tokens
        if s.sample:
            logits.setdefault(s.request.request_id, []).append(
                ex.last_logits[rows[s.request.request_id]].clone()
            )
            s.request.output_token_ids.append(result.sampled[s.request.request_id])


def requests(prompts: list[list[int]]) -> list[Request]:
    return [Request(f"r{i}", p, max_tokens=NUM_OUT) for i, p in enumerate(prompts)]


def prompts_for(config: LlamaConfig, lens=(13, 30, 47)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in lens]


def single_instance(config, sd, prompts) -> tuple[list[list[int]], dict]:
    ex = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK)
    reqs, blocks, logits = requests(prompts), Blocks(128), {}
    while any(r.num_output_tokens < NUM_OUT for r in reqs):
        step(ex, [r for r in reqs if r.num_output_tokens < NUM_OUT], blocks, logits)
    return [r.output_token_ids for r in reqs], logits


def check_same(ref, reqs: list[Request], logits: dict, atol: float) -> None:
    ref_tokens, ref_logits = ref
    assert [r.output_token_ids for r in reqs] == ref_tokens
    for r in reqs:
        torch.testing.assert_close(
            torch.stack(logits[r.request_id]), torch.stack(ref_logits[r.request_id]), atol=atol, rtol=0
        )


@pytest.fixture(scope="module")
def tiny():
    return TINY, random_weights(TINY, seed=0)


def test_merge_by_log_sum_exp_equals_full_softmax_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((2, 3, 8), (2, 20, 8), (2, 20, 8)))
    full, full_lse = partial_attention(q, k, v, 0.35)
    ref = torch.softmax(torch.einsum("hgd,hcd->hgc", q, k) * 0.35, -1) @ v
    torch.testing.assert_close(full, ref)
    parts = [partial_attention(q, k[:, a:b], v[:, a:b], 0.35) for a, b in ((0, 7), (7, 7), (7, 20))]
    out, lse = merge_partial_attention([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)
    assert torch.isinf(parts[1][1]).all() and not parts[1][0].any()  # the empty part weighs nothing


def run_layer_split(config, sd, prompts, k: int) -> tuple[list[Request], dict, LayerSplit]:
    first = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK)
    second = TorchExecutor(config, random_weights(config, seed=99), num_blocks=128, block_size=BLOCK)
    reqs, blocks, logits = requests(prompts), Blocks(128), {}
    late = reqs.pop()  # arrives after the move: its prefill runs through both stages
    while any(r.num_output_tokens < MIGRATE_AFTER for r in reqs):
        step(first, reqs, blocks, logits)
    split = LayerSplit(first, second, k)
    weight_bytes = split.migrate_weights()
    kv_bytes = sum(split.migrate(r) for r in reqs)
    with torch.inference_mode():
        first.kv_cache[k:] = float("nan")  # first no longer holds layers [k, L)
        second.kv_cache[:k] = float("nan")  # second never held layers [0, k)
    layer_params = sum(p.numel() for p in first.model.layers[k].parameters())
    assert weight_bytes >= (config.num_layers - k) * layer_params * 4
    assert (
        kv_bytes
        == (config.num_layers - k)
        * sum(len(r.block_ids) for r in reqs)
        * first.kv_bytes_per_block
        // config.num_layers
    )
    reqs.append(late)
    while any(r.num_output_tokens < NUM_OUT for r in reqs):
        step(split, [r for r in reqs if r.num_output_tokens < NUM_OUT], blocks, logits, chunk=16)
    return reqs, logits, split


@pytest.mark.parametrize("k", [1, 2, 3])
def test_layer_split_across_two_executors_matches_single_instance(tiny, k):
    config, sd = tiny
    prompts = prompts_for(config)
    reqs, logits, split = run_layer_split(config, sd, prompts, k)
    check_same(single_instance(config, sd, prompts), reqs, logits, atol=1e-4)
    assert split.handoff_bytes > 0
    before = len(split._free)
    split.release("r0")
    assert len(split._free) == before + len(reqs[0].block_ids)  # its second-stage blocks come back


def run_attention_split(
    config, sd, prompts, kv_heads, migrate_ids
) -> tuple[list[Request], dict, HelperAttention]:
    home = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK)
    reqs, blocks, logits = requests(prompts), Blocks(128), {}
    while any(r.num_output_tokens < MIGRATE_AFTER for r in reqs):
        step(home, reqs, blocks, logits)
    helper = HelperAttention(home, kv_heads, num_blocks=64)
    split = AttentionSplit(home, helper)
    moved = torch.tensor(kv_heads)
    for r in reqs:
        if r.request_id in migrate_ids:
            nbytes = split.migrate(r)
            full = r.num_computed_tokens // BLOCK
            assert nbytes == full * home.kv_bytes_per_block * len(kv_heads) // config.num_kv_heads
            with torch.inference_mode():  # the home frees its copy of the moved heads' migrated blocks
                idx = torch.tensor(r.block_ids[:full])
                for layer in range(config.num_layers):
                    for kv in range(2):
                        home.kv_cache[layer, kv, moved[:, None], idx[None, :]] = float("nan")
    while any(r.num_output_tokens < NUM_OUT for r in reqs):
        step(split, [r for r in reqs if r.num_output_tokens < NUM_OUT], blocks, logits)
    return reqs, logits, helper


@pytest.mark.parametrize("kv_heads", [[0], [1, 3], [0, 1, 2]])
def test_attention_split_with_helper_matches_single_instance(tiny, kv_heads):
    config, sd = tiny
    prompts = prompts_for(config)
    reqs, logits, helper = run_attention_split(config, sd, prompts, kv_heads, {"r1", "r2"})
    check_same(single_instance(config, sd, prompts), reqs, logits, atol=1e-4)
    assert set(helper.held) == {"r1", "r2"} and helper.exchange_bytes > 0
    free, held = len(helper._free), len(helper.held["r1"][0])
    helper.release("r1")
    assert len(helper._free) == free + held and "r1" not in helper.held


def test_preemption_and_abort_crossing_an_attention_split_lose_nothing(tiny):
    """r1 (migrated) is preempted and recomputed into new blocks, r2 (migrated) aborts: the helper frees
    both, its blocks are conserved, and the survivors' tokens still match the single instance."""
    config, sd = tiny
    prompts = prompts_for(config, (13, 30, 47, 21))
    home = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK)
    reqs, blocks, logits = requests(prompts), Blocks(128), {}
    while any(r.num_output_tokens < MIGRATE_AFTER for r in reqs):
        step(home, reqs, blocks, logits)
    helper = HelperAttention(home, [1, 2], num_blocks=64)
    split = AttentionSplit(home, helper)
    for r in reqs[1:]:
        split.migrate(r)
    held = {rid: len(ids) for rid, (ids, _) in helper.held.items()}
    assert helper.num_free_blocks + sum(held.values()) == 64
    step(split, reqs, blocks, logits)
    r1, r2 = reqs[1], reqs[2]
    r1.block_ids, r1.num_computed_tokens = [], 0  # preempted: recompute from scratch into new blocks
    step(home, [r1], blocks, logits)  # its recompute prefill samples its next token, as a decode would
    split.release(r2.request_id)  # aborted
    survivors = [r for r in reqs if r is not r2]
    while any(r.num_output_tokens < NUM_OUT for r in survivors):
        step(split, [r for r in survivors if r.num_output_tokens < NUM_OUT], blocks, logits)
    assert set(helper.held) == {"r3"} and set(split.sources) == {"r3"}
    assert helper.num_free_blocks == 64 - held["r3"]
    ref_tokens, ref_logits = single_instance(config, sd, prompts)
    for i in (0, 1, 3):
        assert reqs[i].output_token_ids == ref_tokens[i]
    split.release("r3")
    assert helper.num_free_blocks == 64 and not helper.held


def test_bad_splits_name_the_field(tiny):
    config, sd = tiny
    ex = TorchExecutor(config, sd, num_blocks=8, block_size=BLOCK)
    with pytest.raises(ValueError, match="split_layer"):
        LayerSplit(ex, ex, config.num_layers)
    with pytest.raises(ValueError, match="kv_heads"):
        HelperAttention(ex, list(range(config.num_kv_heads)), num_blocks=4)
    r = Request("p", list(range(20)), max_tokens=2)
    r.block_ids = [0, 1, 2]
    with pytest.raises(ValueError, match="num_new_tokens"):
        AttentionSplit(ex, HelperAttention(ex, [0], num_blocks=4)).execute(
            BatchPlan([ScheduledSeq(r, 0, 20, True)], BLOCK)
        )


@pytest.mark.slow
def test_smollm2_layer_and_attention_splits_match_single_instance():
    from kvbalance.model.weights import load_smollm2

    loaded = load_smollm2()
    config, sd, tok = loaded.config, loaded.state_dict, loaded.tokenizer
    texts = [
        "The capital of France is Paris, and the capital of Italy is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there",
    ]
    prompts = [tok(t)["input_ids"] for t in texts]
    ref = single_instance(config, sd, prompts)
    reqs, logits, _ = run_attention_split(config, sd, prompts, [1], {"r0", "r2"})
    check_same(ref, reqs, logits, atol=1e-3)
    first = TorchExecutor(config, sd, num_blocks=64, block_size=BLOCK)
    second = TorchExecutor(config, sd, num_blocks=64, block_size=BLOCK)
    reqs, blocks, logits = requests(prompts), Blocks(64), {}
    while any(r.num_output_tokens < MIGRATE_AFTER for r in reqs):
        step(first, reqs, blocks, logits)
    split = LayerSplit(first, second, 12)
    for r in reqs:
        split.migrate(r)
    with torch.inference_mode():
        first.kv_cache[12:] = float("nan")
    while any(r.num_output_tokens < NUM_OUT for r in reqs):
        step(split, [r for r in reqs if r.num_output_tokens < NUM_OUT], blocks, logits)
    check_same(ref, reqs, logits, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_splits_across_cpu_and_cuda_match_single_instance(tiny):
    config, sd = tiny
    prompts = prompts_for(config)
    ref = single_instance(config, sd, prompts)
    first = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK)
    second = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK, device="cuda")
    reqs, blocks, logits = requests(prompts), Blocks(128), {}
    while any(r.num_output_tokens < MIGRATE_AFTER for r in reqs):
        step(first, reqs, blocks, logits)
    split = LayerSplit(first, second, 2)
    for r in reqs:
        split.migrate(r)
    while any(r.num_output_tokens < NUM_OUT for r in reqs):
        step(split, [r for r in reqs if r.num_output_tokens < NUM_OUT], blocks, logits)
    logits = {k: [x.cpu() for x in v] for k, v in logits.items()}
    check_same(ref, reqs, logits, atol=1e-4)
