"""Sampling behaviour that a broken sampler or executor would change: temperature, seeds under preemption.

Temperature divides the logits before the softmax (p_i ∝ exp(x_i / T)): checked exactly against the
exponential race with the row's own seeded noise, and in distribution. A seeded request draws from a
generator seeded by (seed, position), so its tokens are the same whether or not it was preempted and
recomputed, and whatever the chunk size (the position is the absolute index of the sampled token).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from kvbalance.model.sampling import SampleRequest, row_seed, sample  # noqa: E402
from kvbalance.request import SamplingParams  # noqa: E402

V = 64


def _race(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """The exponential race written out: argmax of softmax(x / T) / E, E ~ Exp(1) from the row's generator."""
    noise = torch.empty(V).exponential_(generator=torch.Generator().manual_seed(row_seed(seed, position)))
    return int((torch.softmax(logits / temperature, dim=-1) / noise).argmax())


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_seeded_token_is_the_exponential_race_over_the_tempered_distribution(temperature):
    x = torch.randn(40, V, generator=torch.Generator().manual_seed(7)) * 2
    params = [SampleRequest(temperature=temperature, seed=11, position=p) for p in range(40)]
    tokens, _ = sample(x, params)
    assert tokens == [_race(x[p], temperature, 11, p) for p in range(40)]


def test_temperature_changes_the_tokens_drawn_with_the_same_noise():
    x = torch.randn(40, V, generator=torch.Generator().manual_seed(7)) * 2
    draw = {
        t: sample(x, [SampleRequest(temperature=t, seed=11, position=p) for p in range(40)])[0]
        for t in (0.25, 1.0, 3.0)
    }
    assert draw[0.25] != draw[1.0] != draw[3.0]
    # a low temperature concentrates on the argmax
    greedy = x.argmax(-1).tolist()
    same = [sum(a == g for a, g in zip(draw[t], greedy)) for t in (0.25, 1.0, 3.0)]
    assert same[0] > same[1] > same[2]


@pytest.mark.parametrize(
    "temperature, expected",
    [
        (0.5, [0.36 / 0.46, 0.09 / 0.46, 0.01 / 0.46]),  # p^2, normalised
        (2.0, [0.6**0.5, 0.3**0.5, 0.1**0.5]),  # sqrt(p), normalised below
    ],
)
def test_temperature_sharpens_or_flattens_the_distribution(temperature, expected):
    probs = torch.tensor([0.6, 0.3, 0.1])
    want = torch.tensor(expected) / sum(expected)
    x = probs.log().repeat(4000, 1)
    tokens, _ = sample(
        x, [SampleRequest(temperature=temperature) for _ in range(4000)], torch.Generator().manual_seed(0)
    )
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, want, atol=0.03)


def _engine(**kw):
    from kvbalance.llm import LLMEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLMEngine("tiny-llama", seed=0, block_size=8, **kw)


def _seeded_outputs(eng, temperature: float = 10.0) -> tuple[list[list[int]], int]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 22, 13)]
    reqs = [
        eng.add_request(
            p, SamplingParams(max_tokens=8, temperature=temperature, seed=100 + i, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
    ]
    while eng.has_unfinished():
        eng.step()
        eng.instance.check_invariants()
    return [r.output_token_ids for r in reqs], sum(r.num_preemptions for r in reqs)


def test_seeded_sampling_gives_the_same_tokens_under_preemption_and_chunking():
    # tiny-llama's random weights give peaked logits: T = 10 makes the draws really random
    roomy, no_preemptions = _seeded_outputs(_engine(kv_cache_tokens=1024, max_num_batched_tokens=1024))
    assert no_preemptions == 0
    tight, preemptions = _seeded_outputs(
        _engine(kv_cache_tokens=48, max_num_batched_tokens=8, enable_prefix_caching=False)
    )
    assert preemptions > 0  # 3 requests of up to 30 tokens in 6 blocks of 8: some are recomputed
    assert tight == roomy
    # the draws are random (temperature reaches the sampler), not greedy decoding in disguise
    greedy, _ = _seeded_outputs(_engine(kv_cache_tokens=1024, max_num_batched_tokens=1024), temperature=0.0)
    assert roomy != greedy
