"""Module migration on real tensors: BanaServe's layer-level and attention-level splits of one model
across two executors, built from the executors' own modules and paged KV caches.

- Layer level (:class:`LayerSplit`): layers ``[0, k)`` run on one executor, ``[k, L)`` on another; the
  KV of the moved layers is copied to the second executor's cache and the hidden state is handed over
  once per step.
- Attention level (:class:`AttentionSplit`): the K/V of some KV heads of running decodes (their full
  blocks at the time of the move) go to a :class:`HelperAttention`, which computes those heads' partial
  attention over what it holds and returns output and log-sum-exp per head; the home computes the
  rest (the other heads, and the moved heads' tokens written since) and merges the two parts by
  log-sum-exp: ``o = sum_i exp(lse_i - lse) o_i`` with ``lse = log sum_i exp(lse_i)``, i.e. the parts'
  outputs weighted by their softmax denominators (FlashAttention's / FlashDecoding's split-KV merge).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvbalance.batch import BatchPlan, StepBreakdown, StepResult
from kvbalance.model.llama import LlamaModel, StepMetadata, apply_rope, attention_dtype, build_step_metadata
from kvbalance.model.sampling import SampleRequest, sample


class PagedExecutor(Protocol):
    """What the splits use of an executor (``kvbalance.executor.torch.TorchExecutor`` has all of it;
    typed structurally so this module stays below the executor layer)."""

    config: object
    model: LlamaModel
    kv_cache: torch.Tensor  # [layers, 2, kv_heads, num_blocks, block_size, head_dim]
    block_size: int
    num_blocks: int
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    generator: torch.Generator
    last_logits: torch.Tensor | None
    last_logits_request_ids: list[str]

    @property
    def kv_bytes_per_block(self) -> int: ...


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per KV-head group over a slice of the context.

    ``q`` [kv_heads, group, head_dim]; ``k``, ``v`` [kv_heads, ctx, head_dim]. Returns the normalised
    output [kv_heads, group, head_dim] and the log-sum-exp of the scaled scores [kv_heads, group]
    (``-inf`` with a zero output over an empty slice), all in float32.
    """
    q, k, v = q.float(), k.float(), v.float()
    if k.shape[1] == 0:
        return torch.zeros_like(q), torch.full(
            q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device
        )
    scores = torch.einsum("hgd,hcd->hgc", q, k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hgc,hcd->hgd", torch.exp(scores - lse[..., None]), v)
    return out, lse


def merge_partial_attention(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions over disjoint key sets: weights ``exp(lse_i - lse)``, ``lse = logsumexp``."""
    lse_all = torch.stack(list(lses))
    lse = torch.logsumexp(lse_all, dim=0)
    w = torch.exp(lse_all - lse)
    w = torch.nan_to_num(w, nan=0.0)  # parts that are all empty (-inf - -inf) weigh nothing
    out = sum(w[i][..., None] * o for i, o in enumerate(outs))
    return out, lse


def set_rope(model: LlamaModel, meta: StepMetadata) -> None:
    """RoPE angles for the step's positions, as ``LlamaModel.forward`` computes them."""
    freqs = meta.positions.float()[:, None] * model.inv_freq.float()[None, :]
    dt = model.embed.weight.dtype
    meta.cos, meta.sin = freqs.cos().to(dt), freqs.sin().to(dt)


def _flatten(plan: BatchPlan, tables: Sequence[Sequence[int]], ex: PagedExecutor):
    """The step's token ids, metadata for ``ex`` with ``tables`` as block tables, and who samples how."""
    token_ids, starts, lens, rows, params, ids = [], [], [], [], [], []
    for b, s in enumerate(plan.seqs):
        r = s.request
        token_ids += r.token_ids(s.start, s.start + s.num_new_tokens)
        starts.append(s.start)
        lens.append(s.num_new_tokens)
        if s.sample:
            sp = r.sampling
            rows.append(b)
            ids.append(r.request_id)
            params.append(
                SampleRequest(
                    sp.temperature, sp.top_k, sp.top_p, sp.seed, sp.logprobs, position=s.context_len
                )
            )
    group = ex.model.layers[0].attn.group
    dtype = attention_dtype(ex.dtype, ex.kv_dtype)
    meta = build_step_metadata(starts, lens, list(tables), rows, ex.block_size, group, ex.device, dtype)
    return torch.tensor(token_ids, dtype=torch.long, device=ex.device), meta, ids, params


def _sample(ex: PagedExecutor, hidden: torch.Tensor, meta: StepMetadata, ids, params) -> StepResult:
    sampled, logprobs = {}, {}
    logits = None
    if ids:
        logits = ex.model.compute_logits(hidden.index_select(0, meta.logits_indices))
        tokens, lps = sample(logits, params, ex.generator)
        for rid, tok, lp in zip(ids, tokens, lps):
            sampled[rid] = tok
            if lp is not None:
                logprobs[rid] = lp
    ex.last_logits, ex.last_logits_request_ids = logits, ids
    return StepResult(0.0, sampled, logprobs, breakdown=StepBreakdown())


# -- layer level -------------------------------------------------------------------------------------


class LayerSplit:
    """Layers ``[0, k)`` on ``first``, ``[k, L)`` on ``second`` (two executors of the same model).

    ``second`` keeps its own block table per request (its blocks are handed out here); the plans keep
    speaking ``first``'s block ids. Sampling happens on ``second``, which holds the LM head's stage.
    """

    def __init__(self, first: PagedExecutor, second: PagedExecutor, split_layer: int) -> None:
        L = first.config.num_layers
        if first.config != second.config:
            raise ValueError("second: runs a different model config than first")
        if not 0 < split_layer < L:
            raise ValueError(f"split_layer: need 0 < k < {L}, got {split_layer}")
        if first.block_size != second.block_size:
            raise ValueError(f"block_size: {first.block_size} on first, {second.block_size} on second")
        self.first, self.second, self.k = first, second, split_layer
        self._free = list(range(second.num_blocks))
        self.tables: dict[str, list[int]] = {}  # request id -> blocks on second
        self.handoff_bytes = 0  # activations handed from first to second, all steps

    def _ensure(self, rid: str, num_blocks: int) -> list[int]:
        t = self.tables.setdefault(rid, [])
        while len(t) < num_blocks:
            if not self._free:
                raise ValueError(f"num_blocks: second executor is out of blocks for request {rid}")
            t.append(self._free.pop(0))
        return t

    def migrate_weights(self) -> int:
        """Copy the weights of layers ``[k, L)`` and of the LM-head stage (final norm, head) to ``second``."""
        f, s = self.first.model, self.second.model
        pairs = [(f.layers[i], s.layers[i]) for i in range(self.k, len(f.layers))] + [(f.norm, s.norm)]
        pairs.append(
            (f.embed, s.embed) if f.lm_head is None else (f.lm_head, s.lm_head)
        )  # tied: the head is embed
        moved = 0
        with torch.inference_mode():
            for src, dst in pairs:
                for a, b in zip(src.parameters(), dst.parameters(), strict=True):
                    b.copy_(a.to(b.device))
                    moved += a.numel() * a.element_size()
        if getattr(self.second, "packed_weights", False):
            s.pack_weights_for_cpu()  # the packed GEMM copies of the overwritten weights
        return moved

    def migrate(self, request) -> int:
        """Copy the KV of layers ``[k, L)`` of ``request``'s blocks to ``second``. Returns bytes moved."""
        src = list(request.block_ids)
        dst = self._ensure(request.request_id, len(src))
        k = self.k
        with torch.inference_mode():
            blocks = self.first.kv_cache[k:].index_select(3, torch.as_tensor(src, device=self.first.device))
            idx = torch.as_tensor(dst, device=self.second.device)
            self.second.kv_cache[k:].index_copy_(3, idx, blocks.to(self.second.device, self.second.kv_dtype))
        return blocks.numel() * blocks.element_size()

    def release(self, request_id: str) -> None:
        """The request finished or left: its blocks on ``second`` return to the free list."""
        self._free.extend(self.tables.pop(request_id, []))

    def execute(self, plan: BatchPlan) -> StepResult:
        seqs = [s for s in plan.seqs if s.num_new_tokens > 0]
        if not seqs:
            return StepResult(0.0)
        plan = BatchPlan(seqs, plan.block_size)
        bs = self.first.block_size
        with torch.inference_mode():
            ids1, meta1, _, _ = _flatten(plan, [s.request.block_ids for s in seqs], self.first)
            set_rope(self.first.model, meta1)
            h = self.first.model.embed(ids1)
            for layer in self.first.model.layers[: self.k]:
                h = layer(h, meta1)
            tables2 = [self._ensure(s.request.request_id, -(-s.context_len // bs)) for s in seqs]
            _, meta2, sids, params = _flatten(plan, tables2, self.second)
            set_rope(self.second.model, meta2)
            h = h.to(self.second.device)  # the activation hand-off
            self.handoff_bytes += h.numel() * h.element_size()
            for layer in self.second.model.layers[self.k :]:
                h = layer(h, meta2)
            return _sample(self.second, h, meta2, sids, params)


# -- attention level ---------------------------------------------------------------------------------


class HelperAttention:
    """A helper GPU's share: the K/V of ``kv_heads`` over migrated blocks, and partial attention on them."""

    def __init__(self, home: PagedExecutor, kv_heads: Sequence[int], num_blocks: int, device="cpu") -> None:
        c = home.config
        heads = sorted(set(kv_heads))
        if not heads or heads[0] < 0 or heads[-1] >= c.num_kv_heads or len(heads) == c.num_kv_heads:
            raise ValueError(
                f"kv_heads: need a proper subset of 0..{c.num_kv_heads - 1}, got {list(kv_heads)}"
            )
        self.kv_heads, self.device, self.block_size = heads, torch.device(device), home.block_size
        self.scale = c.head_dim**-0.5
        shape = (c.num_layers, 2, len(heads), num_blocks, home.block_size, c.head_dim)
        self.cache = torch.zeros(shape, dtype=home.kv_dtype, device=self.device)
        self._free = list(range(num_blocks))
        self.held: dict[str, tuple[list[int], int]] = {}  # request id -> (helper blocks, tokens held)
        self.exchange_bytes = 0  # queries in, outputs + LSE out

    def receive(self, request_id: str, blocks: torch.Tensor, num_tokens: int) -> None:
        """Store ``blocks`` [layers, 2, heads, n, block_size, head_dim] holding ``num_tokens`` tokens."""
        n = blocks.shape[3]
        if n > len(self._free):
            raise ValueError(f"num_blocks: helper has {len(self._free)} free, needs {n} for {request_id}")
        ids, self._free = self._free[:n], self._free[n:]
        with torch.inference_mode():
            self.cache.index_copy_(3, torch.as_tensor(ids, device=self.device), blocks.to(self.device))
        self.held[request_id] = (ids, num_tokens)

    def release(self, request_id: str) -> None:
        ids, _ = self.held.pop(request_id)
        self._free.extend(ids)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def partial(self, request_id: str, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of ``q`` [moved heads, group, head_dim] over the held tokens."""
        ids, n = self.held[request_id]
        qd = q.to(self.device)
        idx = torch.as_tensor(ids, device=self.device)
        k = self.cache[layer, 0].index_select(1, idx).flatten(1, 2)[:, :n]
        v = self.cache[layer, 1].index_select(1, idx).flatten(1, 2)[:, :n]
        out, lse = partial_attention(qd, k, v, self.scale)
        self.exchange_bytes += qd.numel() * qd.element_size() + out.numel() * 4 + lse.numel() * 4
        return out.to(q.device), lse.to(q.device)


class AttentionSplit:
    """The home executor decodes with some heads' migrated context on ``helper``."""

    def __init__(self, home: PagedExecutor, helper: HelperAttention) -> None:
        self.home, self.helper = home, helper
        c = home.config
        self.moved = torch.tensor(helper.kv_heads, dtype=torch.long, device=home.device)
        mask = torch.ones(c.num_kv_heads, dtype=torch.bool)
        mask[helper.kv_heads] = False
        self.kept = torch.nonzero(mask).flatten().to(home.device)
        self.sources: dict[
            str, list[int]
        ] = {}  # request id -> home blocks whose moved heads the helper holds

    def migrate(self, request) -> int:
        """Send the moved heads' K/V of ``request``'s full blocks to the helper. Returns bytes moved."""
        bs = self.home.block_size
        full = request.num_computed_tokens // bs
        if full == 0:
            raise ValueError(f"request: {request.request_id} has no full block to migrate")
        src = torch.as_tensor(request.block_ids[:full], device=self.home.device)
        with torch.inference_mode():
            blocks = self.home.kv_cache.index_select(2, self.moved).index_select(3, src)
        self.helper.receive(request.request_id, blocks, full * bs)
        self.sources[request.request_id] = list(request.block_ids[:full])
        return blocks.numel() * blocks.element_size()

    def release(self, request_id: str) -> None:
        """The request finished, aborted or was preempted: the helper frees its blocks."""
        self.helper.release(request_id)
        del self.sources[request_id]

    def _drop_stale(self, plan: BatchPlan) -> None:
        """A request preempted since its move recomputed its KV into new home blocks: the helper's copy
        is stale, so it is freed and the home attends everything again."""
        for s in plan.seqs:
            rid = s.request.request_id
            src = self.sources.get(rid)
            if src is not None and list(s.request.block_ids[: len(src)]) != src:
                self.release(rid)

    def _attend(self, attn, x: torch.Tensor, meta: StepMetadata, plan: BatchPlan, layer: int) -> torch.Tensor:
        t, kvh, hd, g = x.shape[0], attn.num_kv_heads, attn.head_dim, attn.group
        q, k, v = attn.qkv(x).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
        q = apply_rope(q.view(t, attn.num_heads, hd), meta.cos, meta.sin).view(t, kvh, g, hd)
        k = apply_rope(k.view(t, kvh, hd), meta.cos, meta.sin)
        dt = attn.k_cache.dtype
        attn.k_cache.view(kvh, -1, hd).index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(dt))
        attn.v_cache.view(kvh, -1, hd).index_copy_(
            1, meta.slot_mapping, v.view(t, kvh, hd).transpose(0, 1).to(dt)
        )
        out = torch.empty(t, kvh, g, hd, dtype=torch.float32, device=x.device)
        for b, s in enumerate(plan.seqs):
            idx = torch.as_tensor(s.request.block_ids, device=x.device)
            kc = attn.k_cache.index_select(1, idx).flatten(1, 2)[:, : s.context_len]
            vc = attn.v_cache.index_select(1, idx).flatten(1, 2)[:, : s.context_len]
            held = self.helper.held.get(s.request.request_id)
            if held is None:
                out[b] = partial_attention(q[b], kc, vc, attn.scale)[0]
                continue
            m = held[1]
            out[b, self.kept] = partial_attention(q[b, self.kept], kc[self.kept], vc[self.kept], attn.scale)[
                0
            ]
            qm = q[b, self.moved]
            home = partial_attention(qm, kc[self.moved, m:], vc[self.moved, m:], attn.scale)
            helper = self.helper.partial(s.request.request_id, layer, qm)
            out[b, self.moved] = merge_partial_attention([home[0], helper[0]], [home[1], helper[1]])[0]
        return attn.o(out.to(x.dtype).view(t, attn.q_size))

    def execute(self, plan: BatchPlan) -> StepResult:
        """A decode-only step (one new token per request); migrated requests merge with the helper."""
        if any(s.num_new_tokens != 1 for s in plan.seqs):
            raise ValueError("num_new_tokens: the attention split runs decode steps only (1 token each)")
        if not plan.seqs:
            return StepResult(0.0)
        self._drop_stale(plan)
        model = self.home.model
        with torch.inference_mode():
            ids, meta, sids, params = _flatten(plan, [s.request.block_ids for s in plan.seqs], self.home)
            set_rope(model, meta)
            h = model.embed(ids)
            for i, layer in enumerate(model.layers):
                h = h + self._attend(layer.attn, layer.input_norm(h), meta, plan, i)
                h = h + layer.mlp(layer.post_attn_norm(h))
            return _sample(self.home, h, meta, sids, params)
