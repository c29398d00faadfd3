"""The real engine, driven by the real scheduler, against transformers' LlamaForCausalLM.

Greedy tokens must be identical to HF ``generate`` with the same weights for a batch of varied
prompts that share prefixes: unchunked and with chunk sizes 16 and 64, with and without prefix
caching, and under forced preemption (a KV cache too small for all requests at once).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvbalance.llm import LLMEngine  # noqa: E402
from kvbalance.model.weights import native_to_hf  # noqa: E402
from kvbalance.request import SamplingParams  # noqa: E402

MAX_TOKENS = 12


def _prompts():
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 50, 1)]
    prompts += [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 33, 90)]
    return prompts


def _engine(**kw) -> LLMEngine:
    kw.setdefault("block_size", 16)  # small blocks: the 40-token shared prefix spans two full blocks
    kw.setdefault("dtype", "float32")  # token-identical to transformers' float32 (bf16: tests/test_bf16.py)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLMEngine("tiny-llama", seed=0, **kw)


@pytest.fixture(scope="module")
def hf_reference():
    eng = _engine(kv_cache_tokens=4096)
    cfg = eng.config
    hf_cfg = transformers.LlamaConfig(
        **{k: v for k, v in cfg.to_hf_config().items() if k != "rope_parameters"}
    )
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd = native_to_hf({k: v.float() for k, v in eng.executor.model.state_dict().items()}, cfg)
    model.load_state_dict(sd, strict=False)
    outs = []
    with torch.inference_mode():
        for p in _prompts():
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                min_new_tokens=MAX_TOKENS,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def _run(eng: LLMEngine) -> list[list[int]]:
    reqs = [eng.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in _prompts()]
    while eng.has_unfinished():
        eng.step()
        eng.instance.check_invariants()
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("chunk", [16, 64, 4096])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_tokens_match_transformers(hf_reference, chunk, prefix_caching):
    eng = _engine(kv_cache_tokens=4096, max_num_batched_tokens=chunk, enable_prefix_caching=prefix_caching)
    assert _run(eng) == hf_reference
    if prefix_caching and chunk == 16:  # later prompts are admitted after the shared blocks are cached
        assert eng.instance.scheduler.prefix_hit_tokens > 0


def test_prefix_hits_across_batches_match(hf_reference):
    eng = _engine(kv_cache_tokens=4096, max_num_batched_tokens=64)
    _run(eng)  # fills the cache
    assert _run(eng) == hf_reference  # second pass: whole prompts from cache but the last block
    assert eng.instance.scheduler.prefix_hit_tokens >= 40 * 4


@pytest.mark.parametrize("chunk", [16, 4096])
def test_greedy_tokens_match_under_forced_preemption(hf_reference, chunk):
    eng = _engine(kv_cache_tokens=176, block_size=8, max_num_batched_tokens=chunk, max_num_seqs=8)
    assert _run(eng) == hf_reference
    assert eng.instance.scheduler.num_preemptions > 0
