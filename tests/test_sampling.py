"""Batched sampling: greedy, top-k / top-p masks, seeds that ignore batch composition, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvbalance.model.sampling import SampleRequest, apply_top_k_top_p, sample

V = 50


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_picks_argmax():
    x = logits_rows(4)
    tokens, lps = sample(x, [SampleRequest() for _ in range(4)])
    assert tokens == x.argmax(-1).tolist() and lps == [None] * 4


def test_top_k_keeps_exactly_k_best():
    x = logits_rows(3)
    out = apply_top_k_top_p(x, torch.tensor([1, 5, 0]), torch.ones(3))
    kept = torch.isfinite(out).sum(-1).tolist()
    assert kept == [1, 5, V]
    assert set(out[1].isfinite().nonzero().flatten().tolist()) == set(x[1].topk(5).indices.tolist())


def test_top_p_keeps_smallest_nucleus():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]]))
    out = apply_top_k_top_p(x, torch.zeros(3, dtype=torch.long), torch.tensor([0.7, 0.8, 0.5]))
    assert torch.isfinite(out).tolist() == [
        [True, True, False, False],  # 0.5 < 0.7 -> need the 0.3 too
        [True, True, False, False],  # 0.8 reached exactly by the first two
        [True, False, False, False],  # the top token alone is always kept
    ]


def test_sampling_never_leaves_the_allowed_set():
    x = logits_rows(1).repeat(200, 1)
    params = [SampleRequest(temperature=1.5, top_k=3) for _ in range(200)]
    tokens, _ = sample(x, params, torch.Generator().manual_seed(1))
    assert set(tokens) <= set(x[0].topk(3).indices.tolist())
    assert len(set(tokens)) > 1


def test_seeded_request_ignores_batch_composition():
    x = logits_rows(6, seed=3)
    mine = SampleRequest(temperature=1.0, top_p=0.9, seed=42, position=17)
    alone, _ = sample(x[2:3], [mine])
    others = [
        SampleRequest(temperature=0.7, seed=None),
        SampleRequest(),
        SampleRequest(temperature=2.0, seed=5),
    ]
    batch = torch.cat([x[0:1], x[1:2], x[2:3], x[3:4]])
    mixed, _ = sample(batch, [others[0], others[1], mine, others[2]], torch.Generator().manual_seed(9))
    assert mixed[2] == alone[0]
    # a different position draws fresh noise: over many positions the tokens vary
    draws = {sample(x[2:3], [SampleRequest(temperature=1.0, seed=42, position=p)])[0][0] for p in range(30)}
    assert len(draws) > 1


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    x = probs.log().repeat(4000, 1)
    tokens, _ = sample(
        x, [SampleRequest(temperature=1.0) for _ in range(4000)], torch.Generator().manual_seed(0)
    )
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_shape_and_values(k):
    x = logits_rows(3, seed=4)
    params = [SampleRequest(logprobs=k), SampleRequest(), SampleRequest(temperature=1.0, seed=1, logprobs=k)]
    tokens, lps = sample(x, params)
    assert lps[1] is None
    ref = x.log_softmax(-1)
    for i in (0, 2):
        lp = lps[i]
        assert lp.token_id == tokens[i]
        assert math.isclose(lp.logprob, ref[i, tokens[i]].item(), abs_tol=1e-5)
        assert len(lp.top_ids) == len(lp.top_logprobs) == k
        assert lp.top_ids == ref[i].topk(k).indices.tolist() if k else lp.top_ids == []
    assert lps[0].rank == 1  # greedy picks the most likely token


def test_mismatched_params_are_rejected():
    with pytest.raises(ValueError, match="params"):
        sample(logits_rows(2), [SampleRequest()])
