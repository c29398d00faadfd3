"""The PyTorch executor matches transformers' Llama token for token over the paged KV cache.

Plans are built by hand (no scheduler): whole prefills, chunked prefills mixed with other
sequences' decodes, a prefix hit on shared physical blocks, and a preemption that recomputes.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvbalance.batch import BatchPlan, KVTransfer, ScheduledSeq
from kvbalance.executor.torch import TorchExecutor
from kvbalance.model import llama
from kvbalance.model.llama import LlamaConfig, build_step_metadata, rope_inv_freq
from kvbalance.model.weights import native_to_hf, random_weights
from kvbalance.request import Request, SamplingParams

transformers = pytest.importorskip("transformers")

BLOCK = 16
PROMPT_LENS = [5, 17, 33, 64, 100]
NUM_OUT = 8
ATOL = 1e-4

TINY = LlamaConfig(
    name="tiny-test",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_context=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
TINY_LLAMA3 = LlamaConfig(
    **{
        **TINY.to_dict(),
        "name": "tiny-llama3",
        "tie_word_embeddings": True,
        "qkv_bias": True,
        "o_bias": True,
        "rope_theta": 500000.0,
        "max_context": 256,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_model_for(config: LlamaConfig, state_dict: dict) -> torch.nn.Module:
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_config()))
    missing, unexpected = hf.load_state_dict(native_to_hf(state_dict, config), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


class Blocks:
    """Hands out physical blocks in a shuffled order so block tables are never the identity."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out


def ensure_blocks(req: Request, blocks: Blocks, upto: int) -> None:
    need = -(-upto // BLOCK) - len(req.block_ids)
    if need > 0:
        req.block_ids.extend(blocks.take(need))


def step(ex: TorchExecutor, reqs: list[Request], blocks: Blocks, chunk: int | None, logits: dict) -> None:
    """One hand-built step: every request computes min(chunk, missing) tokens, decodes listed first."""
    seqs = []
    for r in reqs:
        n = r.num_tokens - r.num_computed_tokens
        if chunk is not None:
            n = min(n, chunk)
        ensure_blocks(r, blocks, r.num_computed_tokens + n)
        seqs.append(ScheduledSeq(r, r.num_computed_tokens, n, r.num_computed_tokens + n == r.num_tokens))
    seqs.sort(key=lambda s: s.is_prefill)
    result = ex.execute(BatchPlan(seqs, BLOCK))
    rows = {rid: i for i, rid in enumerate(ex.last_logits_request_ids)}
    for s in seqs:
        r = s.request
        r.num_computed_tokens += s.num_new_tokens
        if s.sample:
            logits.setdefault(r.request_id, []).append(ex.last_logits[rows[r.request_id]].clone())
            r.output_token_ids.append(result.sampled[r.request_id])
    assert result.duration_s > 0 and result.breakdown.compute_s > 0


def hf_reference(hf, prompt: list[int], num_out: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from ``generate`` and the logits that chose each of them (memoised per model).

    The memo lives on the model object itself: a dict keyed on ``id(hf)`` would hand a freed model's
    results to a new model that happens to get the same address.
    """
    cache = hf.__dict__.setdefault("_kvbalance_reference_cache", {})
    key = (tuple(prompt), num_out)
    if key not in cache:
        cache[key] = _hf_reference(hf, prompt, num_out)
    return cache[key]


def _hf_reference(hf, prompt: list[int], num_out: int) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        ids = torch.tensor([prompt])  # explicit mask: token 0 (the pad id) may occur in a prompt
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_out, do_sample=False)
        tokens = out[0, len(prompt) :].tolist()
        logits = hf(out[:, :-1]).logits[0, len(prompt) - 1 :]
    return tokens, logits


def make_prompts(lens: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def check_against_hf(hf, reqs: list[Request], logits: dict) -> None:
    for r in reqs:
        ref_tokens, ref_logits = hf_reference(hf, list(r.prompt_token_ids), r.num_output_tokens)
        assert r.output_token_ids == ref_tokens, r.request_id
        ours = torch.stack(logits[r.request_id])
        torch.testing.assert_close(ours, ref_logits, atol=ATOL, rtol=0)


@pytest.fixture(scope="module", params=[TINY, TINY_LLAMA3], ids=lambda c: c.name)
def setup(request):
    config = request.param
    sd = random_weights(config, seed=0)
    return config, sd, hf_model_for(config, sd)


def new_requests(config: LlamaConfig, lens: list[int] = PROMPT_LENS) -> list[Request]:
    return [
        Request(f"r{i}", p, max_tokens=NUM_OUT) for i, p in enumerate(make_prompts(lens, config.vocab_size))
    ]


def test_unchunked_prefill_then_decodes_match_hf(setup):
    config, sd, hf = setup
    ex = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK)
    reqs, blocks, logits = new_requests(config), Blocks(128), {}
    for _ in range(NUM_OUT):
        step(ex, reqs, blocks, None, logits)
    check_against_hf(hf, reqs, logits)


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_mixed_with_decodes_matches_hf(setup, chunk):
    config, sd, hf = setup
    ex = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK)
    pending, blocks, logits = new_requests(config), Blocks(128, seed=chunk), {}
    running: list[Request] = []
    while pending or any(r.num_output_tokens < NUM_OUT for r in running):
        if pending:  # admit one request per step, so its chunks share steps with others' decodes
            running.append(pending.pop())
        active = [r for r in running if r.num_output_tokens < NUM_OUT]
        step(ex, active, blocks, chunk, logits)
    check_against_hf(hf, running, logits)


def test_many_decodes_of_varied_context_split_into_groups_match_hf(setup):
    config, sd, hf = setup
    lens = [3, 7, 12, 20, 31, 45, 60, 90, 130, 170, 220, 300]
    ex = TorchExecutor(config, sd, num_blocks=256, block_size=BLOCK)
    pending, blocks, logits = new_requests(config, lens), Blocks(256, seed=11), {}
    running: list[Request] = []
    while pending or any(r.num_output_tokens < NUM_OUT for r in running):
        running.extend(pending[:4])  # batches of arrivals: 64-token chunks beside grouped decodes
        del pending[:4]
        step(ex, [r for r in running if r.num_output_tokens < NUM_OUT], blocks, 64, logits)
    check_against_hf(hf, running, logits)


def test_decode_sub_batches_for_cache_sized_gathers_match_hf(setup, monkeypatch):
    config, sd, hf = setup
    monkeypatch.setattr(llama, "GATHER_BUDGET_BYTES", 1)  # every sequence gathers on its own
    ex = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK)
    reqs, blocks, logits = new_requests(config), Blocks(128, seed=2), {}
    for _ in range(NUM_OUT):
        step(ex, reqs, blocks, None, logits)
    check_against_hf(hf, reqs, logits)


@pytest.mark.parametrize("kv_dtype, atol", [(torch.float16, 2e-2), (torch.bfloat16, 1e-1)], ids=str)
def test_half_precision_kv_cache_keeps_greedy_tokens(setup, kv_dtype, atol):
    config, sd, hf = setup
    ex = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK, kv_dtype=kv_dtype)
    assert ex.kv_cache.dtype == kv_dtype
    assert ex.kv_bytes_per_block == config.num_layers * 2 * BLOCK * config.num_kv_heads * config.head_dim * 2
    reqs, blocks, logits = new_requests(config), Blocks(128, seed=6), {}
    for _ in range(NUM_OUT):
        step(ex, reqs, blocks, 16, logits)
    for r in reqs:
        ref_tokens, ref_logits = hf_reference(hf, list(r.prompt_token_ids), r.num_output_tokens)
        assert r.output_token_ids == ref_tokens
        torch.testing.assert_close(torch.stack(logits[r.request_id]), ref_logits, atol=atol, rtol=0)


def test_decodes_split_by_context_length():
    meta = build_step_metadata(
        [5] * 6 + [400] * 6, [1] * 12, [list(range(26))] * 12, list(range(12)), BLOCK, 2, "cpu", torch.float32
    )
    assert sorted(g.batch_size for g in meta.groups) == [6, 6]
    assert {g.ctx_blocks for g in meta.groups} == {1, 26}


def test_prefix_hit_on_shared_blocks_matches_hf(setup):
    config, sd, hf = setup
    ex = TorchExecutor(config, sd, num_blocks=64, block_size=BLOCK)
    blocks, logits = Blocks(64), {}
    prefix, tail_a, tail_b = make_prompts([40, 9, 21], config.vocab_size, seed=5)
    a = Request("a", prefix + tail_a, max_tokens=NUM_OUT)
    step(ex, [a], blocks, None, logits)
    shared = 2 * BLOCK  # B reuses A's first two full blocks; only its own tokens are computed
    b = Request("b", prefix + tail_b, max_tokens=NUM_OUT)
    b.block_ids = a.block_ids[:2]
    b.num_computed_tokens = b.num_cached_tokens = shared
    while b.num_output_tokens < NUM_OUT or a.num_output_tokens < NUM_OUT:
        step(ex, [r for r in (a, b) if r.num_output_tokens < NUM_OUT], blocks, None, logits)
    assert b.block_ids[:2] == a.block_ids[:2]
    check_against_hf(hf, [a, b], logits)


def test_preempted_sequence_recomputes_into_new_blocks(setup):
    config, sd, hf = setup
    ex = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK)
    reqs, blocks, logits = new_requests(config, [23, 50, 70]), Blocks(128, seed=3), {}
    for _ in range(4):
        step(ex, reqs, blocks, None, logits)
    victim = reqs[1]
    old = victim.block_ids
    ex.write_blocks(old, torch.randn_like(ex.read_blocks(old)))  # the freed blocks get reused by others
    victim.block_ids, victim.num_computed_tokens = [], 0
    victim.num_preemptions += 1
    while any(r.num_output_tokens < NUM_OUT for r in reqs):
        step(ex, [r for r in reqs if r.num_output_tokens < NUM_OUT], blocks, 32, logits)
    assert not set(victim.block_ids) & set(old)
    check_against_hf(hf, reqs, logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chunked_steps_match_hf(setup):
    config, sd, hf = setup
    ex = TorchExecutor(config, sd, num_blocks=128, block_size=BLOCK, device="cuda")
    pending, blocks, logits = new_requests(config), Blocks(128, seed=4), {}
    running: list[Request] = []
    while pending or any(r.num_output_tokens < NUM_OUT for r in running):
        if pending:
            running.append(pending.pop())
        step(ex, [r for r in running if r.num_output_tokens < NUM_OUT], blocks, 16, logits)
    logits = {k: [x.cpu() for x in v] for k, v in logits.items()}
    check_against_hf(hf, running, logits)


def test_preset_spec_builds_an_executor():
    specs = pytest.importorskip("kvbalance.specs")
    config = LlamaConfig.from_spec(specs.get_model("tiny-llama"))
    ex = TorchExecutor(config, random_weights(config, seed=1), num_blocks=8, block_size=BLOCK)
    r = Request("p", [1, 2, 3])
    r.block_ids = [5]
    assert set(ex.execute(BatchPlan([ScheduledSeq(r, 0, 3, True)], BLOCK)).sampled) == {"p"}


def test_llama3_rope_frequencies_match_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**TINY_LLAMA3.to_hf_config())
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    torch.testing.assert_close(rope_inv_freq(TINY_LLAMA3), ref)


def test_block_copy_read_write_roundtrip():
    ex = TorchExecutor(TINY, random_weights(TINY), num_blocks=8, block_size=BLOCK)
    blob = torch.randn_like(ex.read_blocks([1, 2]))
    ex.write_blocks([1, 2], blob)
    ex.copy_blocks([1, 2], [5, 6])
    torch.testing.assert_close(ex.read_blocks([6, 5]), blob.flip(2))
    assert ex.kv_bytes_per_block == blob[:, :, 0].numel() * 4
    with pytest.raises(ValueError, match="block_ids"):
        ex.read_blocks([8])


def test_seeded_sampling_and_logprobs_through_executor():
    ex = TorchExecutor(TINY, random_weights(TINY), num_blocks=16, block_size=BLOCK)
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=20, seed=7, logprobs=3)
    r = Request("s", list(range(10)), params)
    r.block_ids = [0]
    res = ex.execute(BatchPlan([ScheduledSeq(r, 0, 10, True)], BLOCK))
    lp = res.logprobs["s"]
    assert lp.token_id == res.sampled["s"] and len(lp.top_ids) == 3 and lp.logprob <= 0


def test_bad_plans_name_the_field():
    ex = TorchExecutor(TINY, random_weights(TINY), num_blocks=4, block_size=BLOCK)
    r = Request("x", list(range(20)))
    r.block_ids = [0]
    with pytest.raises(ValueError, match="block_ids"):
        ex.execute(BatchPlan([ScheduledSeq(r, 0, 20, True)], BLOCK))
    with pytest.raises(ValueError, match="block_size"):
        ex.execute(BatchPlan([ScheduledSeq(r, 0, 4, False)], 32))
    with pytest.raises(ValueError, match="kv_loads"):
        ex.execute(BatchPlan([], BLOCK, kv_loads=[KVTransfer("x", [0], 16, "load")]))


@pytest.mark.slow
def test_smollm2_matches_transformers_from_gguf():
    from kvbalance.model.weights import load_smollm2, smollm2_gguf_path

    loaded = load_smollm2()
    gguf = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    hf.eval()
    tok = loaded.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there"]
    ex = TorchExecutor(loaded.config, loaded.state_dict, num_blocks=64, block_size=BLOCK)
    reqs = [Request(f"s{i}", tok(t)["input_ids"], max_tokens=NUM_OUT) for i, t in enumerate(texts)]
    blocks, logits = Blocks(64), {}
    for _ in range(NUM_OUT):
        step(ex, reqs, blocks, 4, logits)  # chunked: 4-token prefill chunks mixed with decodes
    while any(r.num_output_tokens < NUM_OUT for r in reqs):
        step(ex, [r for r in reqs if r.num_output_tokens < NUM_OUT], blocks, 4, logits)
    for r in reqs:
        ref_tokens, ref_logits = hf_reference(hf, list(r.prompt_token_ids), NUM_OUT)
        assert r.output_token_ids == ref_tokens
        torch.testing.assert_close(torch.stack(logits[r.request_id]), ref_logits, atol=1e-3, rtol=0)


@pytest.mark.skipif(not llama._can_pack(torch.zeros(1)), reason="no MKL in this torch build")
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 100, 513])
def test_mkl_packed_linear_equals_the_plain_matmul(rows):
    g = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(96, 200, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=g))
        layer.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(rows, 96, generator=g)
    with torch.inference_mode():
        plain = layer(x)
        layer.packed_weight = llama._pack(layer.weight)
        layer.packed_version = llama._version(layer.weight)
        packed = llama.linear(x, layer)
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-5)


def test_cpu_executor_packs_its_weights():
    ex = TorchExecutor(TINY, random_weights(TINY, seed=0), num_blocks=8, block_size=BLOCK)
    assert ex.packed_weights == llama._can_pack(torch.zeros(1))
    ex16 = TorchExecutor(
        TINY, random_weights(TINY, seed=0), num_blocks=8, block_size=BLOCK, dtype=torch.bfloat16
    )
    assert ex16.packed_weights == llama.native_bf16_matmul()  # oneDNN's blocked bf16 layout


@pytest.mark.skipif(not llama._can_pack(torch.zeros(1)), reason="no MKL in this torch build")
def test_weights_overwritten_in_place_are_packed_again():
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(32, 48, bias=False)
    x = torch.randn(5, 32, generator=g)
    with torch.inference_mode():
        layer.packed_weight, layer.packed_version = llama._pack(layer.weight), layer.weight._version
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 32, generator=g))  # e.g. weights migrated in from another executor
    with torch.inference_mode():
        torch.testing.assert_close(llama.linear(x, layer), x @ layer.weight.T, atol=1e-5, rtol=1e-5)


def test_smollm2_converts_from_its_gguf_into_a_fresh_cache(tmp_path, monkeypatch):
    """A fresh machine has no converted copy: the torch extra alone must turn the shipped GGUF into weights
    (transformers needs ``accelerate`` for GGUF files; without it ``serve --model smollm2-135m`` failed on
    first use while every test here ran on a cache converted earlier)."""
    from kvbalance.model.weights import SMOLLM2_NAME, load_smollm2, smollm2_gguf_path
    from kvbalance.specs import get_model

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("KVBALANCE_CACHE", str(tmp_path))
    loaded = load_smollm2(with_tokenizer=True)
    assert (tmp_path / SMOLLM2_NAME / "config.json").is_file()
    spec, cfg = get_model("smollm2-135m"), loaded.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (
        spec.num_layers,
        spec.hidden_size,
        spec.vocab_size,
    )
    assert loaded.tokenizer.encode("Hello") and not loaded.random_weights
    assert all(torch.isfinite(t).all() for t in loaded.state_dict.values())
