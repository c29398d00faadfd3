"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds, top logprobs, logit bias
and OpenAI's presence / frequency penalties.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws from p.
A seeded request gets its own generator seeded from ``(seed, position)``, so its tokens depend
only on its own seed and logits: never on batch composition, and a recompute after preemption
draws the same token again. Stop strings, stop ids and length limits belong to the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's rule): logits / 1e-40 overflow to NaN
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant for combining seed and position
_MASK63 = (1 << 63) - 1


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the ``k`` most likely tokens (raw model distribution)."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SampleRequest:
    """One row's sampling settings; ``position`` is the index the sampled token will take."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    position: int = 0
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output_token_ids: Sequence[int] = ()  # the output so far (penalties count over it)

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def row_seed(seed: int, position: int) -> int:
    return ((seed * _MIX) ^ (position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB)) & _MASK63


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf. ``top_k`` 0 and ``top_p`` 1 are off.

    ``logits`` [S, V] float; ``top_k`` [S] long; ``top_p`` [S] float. Ties at the k-th value are kept.
    """
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    if bool((k < vocab).any()):
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # keep a token while the mass before it is < p
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def apply_logit_adjustments(logits: torch.Tensor, params: list[SampleRequest]) -> torch.Tensor:
    """OpenAI's adjustment, per row: ``mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j]``.

    ``c[j]`` counts token ``j`` in the row's output so far. Returns ``logits`` itself when no row adjusts.
    """
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        p = params[i]
        if p.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            ids = torch.as_tensor(list(p.output_token_ids), device=logits.device, dtype=torch.long)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= counts * p.frequency_penalty + (counts > 0).to(logits.dtype) * p.presence_penalty
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device, dtype=torch.long)
            bias = torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
            logits[i].index_add_(0, ids, bias)
    return logits


def sample(
    logits: torch.Tensor, params: list[SampleRequest], generator: torch.Generator | None = None
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick one token per row of ``logits`` [S, V] (float32). Returns token ids and optional logprobs.

    Logit bias and penalties shape the choice; logprobs are of the raw model distribution (vLLM's default).
    """
    s = logits.shape[0]
    if s != len(params):
        raise ValueError(f"params: {len(params)} entries for {s} logit rows")
    if s == 0:
        return [], []
    adjusted = apply_logit_adjustments(logits, params)
    greedy_tokens = adjusted.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if p.temperature >= SAMPLING_EPS]
    if random_rows:
        device = logits.device
        idx = torch.tensor(random_rows, device=device)
        rows = adjusted.index_select(0, idx)
        temp = torch.tensor([params[i].temperature for i in random_rows], device=device, dtype=rows.dtype)
        top_k = torch.tensor([params[i].top_k for i in random_rows], device=device, dtype=torch.long)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=device, dtype=rows.dtype)
        rows = apply_top_k_top_p(rows / temp[:, None], top_k, top_p)
        probs = rows.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(random_rows) if params[i].seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_(
                generator=generator
            )
        for j, i in enumerate(random_rows):
            p = params[i]
            if p.seed is not None:
                gen = torch.Generator(device=device).manual_seed(row_seed(p.seed, p.position))
                noise[j].exponential_(generator=gen)
        picked = (probs / noise.clamp_(min=1e-30)).argmax(dim=-1)
        greedy_tokens = greedy_tokens.index_copy(0, idx, picked)
    tokens = greedy_tokens.tolist()
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * s
    if lp_rows:
        idx = torch.tensor(lp_rows, device=logits.device)
        logp = logits.index_select(0, idx).float().log_softmax(dim=-1)
        chosen = torch.tensor([tokens[i] for i in lp_rows], device=logits.device)
        chosen_lp = logp.gather(1, chosen[:, None])[:, 0]
        ranks = (logp > chosen_lp[:, None]).sum(dim=-1) + 1
        kmax = max(params[i].logprobs for i in lp_rows)
        top = logp.topk(kmax, dim=-1) if kmax > 0 else None
        chosen_lp, ranks = chosen_lp.tolist(), ranks.tolist()
        top_ids = top.indices.tolist() if top is not None else None
        top_vals = top.values.tolist() if top is not None else None
        for j, i in enumerate(lp_rows):
            k = params[i].logprobs
            out[i] = TokenLogprobs(
                token_id=tokens[i],
                logprob=chosen_lp[j],
                rank=ranks[j],
                top_ids=top_ids[j][:k] if k else [],
                top_logprobs=top_vals[j][:k] if k else [],
            )
    return tokens, out
