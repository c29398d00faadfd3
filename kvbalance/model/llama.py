"""A Llama-architecture decoder in plain PyTorch that computes one step over a paged KV cache.

One forward runs a flattened mix of prefill chunks and decodes (tokens of all sequences
concatenated). Each layer writes the new tokens' K/V into their cache slots (one
``index_copy_`` over the step's slot mapping), gathers each sequence's context by whole blocks
through its block table into a padded batch, and runs ``scaled_dot_product_attention`` per
attention group (decodes, split by context length, and prefill chunks). The per-step
bookkeeping (slot mapping, gather indices, masks, RoPE angles) lives in :class:`StepMetadata`,
built once per step and shared by all layers, so ``forward(input_ids, meta)`` stays plain. The
configuration is in ``llama_config.py``, the metadata in ``step_metadata.py`` (both re-exported here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbalance.model import decode_step, fused, native, native_prefill
from kvbalance.model.llama_config import LLAMA_LIKE_ARCHS as LLAMA_LIKE_ARCHS  # re-exported
from kvbalance.model.llama_config import LlamaConfig, rope_inv_freq
from kvbalance.model.packed import _can_pack, _pack, _packed_linear, _version, linear
from kvbalance.model.packed import native_bf16_matmul as native_bf16_matmul  # re-exported
from kvbalance.model.step_metadata import AttnGroup, StepMetadata
from kvbalance.model.step_metadata import attention_dtype as attention_dtype  # re-exported
from kvbalance.model.step_metadata import build_step_metadata as build_step_metadata  # re-exported

GATHER_BUDGET_BYTES = 4 << 20  # CPU decode: gathered K+V per attention call, sized to stay in cache


# -- layers ---------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics and scaling whatever the dtype. For bfloat16 it rounds once, after the weight;
        # HF's LlamaRMSNorm rounds the normalised x, then the product (ulp-level differences, and 10x
        # fewer passes over the activations). bf16 on the CPU: the same maths in one C pass (fused.py).
        if x.dim() == 2 and self.weight.dtype == x.dtype and fused.supports(x):
            return fused.rms_norm(x, self.weight, self.eps)
        if x.dtype in (torch.float32, torch.bfloat16):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout). ``x`` [T, heads, head_dim]; ``cos``/``sin`` [T, head_dim / 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention over the paged cache; ``k_cache``/``v_cache`` are bound by the executor.

    Caches are head-major, ``[kv_heads, num_blocks, block_size, head_dim]``: gathering whole
    blocks then yields each head's context as one contiguous ``[ctx, head_dim]`` run, which the
    CPU attention kernel reads about twice as fast as a token-major (strided) gather.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.group = config.num_heads // config.num_kv_heads
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.scale = config.head_dim**-0.5
        self.k_cache: torch.Tensor | None = None  # [kv_heads, num_blocks, block_size, head_dim]
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        t, kvh, hd = x.shape[0], self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv)
        # q and k heads sit side by side in the fused output: one RoPE over both
        if meta.cos.dtype == qkv.dtype and fused.supports(qkv):  # on the CPU: in place
            fused.rope_(qkv, meta.cos, meta.sin, self.num_heads + kvh, hd)
            q, k, v = qkv.view(t, -1, hd).split((self.num_heads, kvh, kvh), dim=1)
        else:
            qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
            qk = apply_rope(qk.view(t, self.num_heads + kvh, hd), meta.cos, meta.sin)
            q, k = qk.split((self.num_heads, kvh), dim=1)
            v = v.view(t, kvh, hd)
        kv_dtype = self.k_cache.dtype  # may be narrower than the model's (halves the bytes attention reads)
        if native.can_write_kv(k, v, self.k_cache):
            native.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        else:
            self.k_cache.view(kvh, -1, hd).index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(kv_dtype))
            self.v_cache.view(kvh, -1, hd).index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(kv_dtype))
        if len(meta.groups) == 1 and meta.groups[0].token_index is None:
            return linear(self._attend(q, meta.groups[0], k, v), self.o)
        out = q.new_empty(t, self.q_size)
        for g in meta.groups:
            idx = g.token_index
            if g.max_q > 1 and g.q_start == 0:  # a whole prompt: its keys are this step's k, v
                out.index_copy_(
                    0,
                    idx,
                    self._attend(q.index_select(0, idx), g, k.index_select(0, idx), v.index_select(0, idx)),
                )
            else:
                out.index_copy_(0, idx, self._attend(q.index_select(0, idx), g))
        return linear(out, self.o)

    def _gather(
        self, cache: torch.Tensor, block_index: torch.Tensor, b: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Contexts of ``b`` sequences from whole blocks -> ``[b, kv_heads, ctx, head_dim]`` (head-major copy)."""
        kvh, num_blocks, block_size, hd = cache.shape
        rows = (
            cache.view(kvh, num_blocks, block_size * hd).index_select(1, block_index).to(dtype)
        )  # contiguous
        return rows.view(kvh, b, -1, hd).transpose(0, 1)

    def _attend(
        self,
        q: torch.Tensor,
        g: AttnGroup,
        k_new: torch.Tensor | None = None,
        v_new: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one group's queries ``[n, heads, head_dim]`` -> ``[n, heads * head_dim]``.

        Runs in ``attention_dtype(model dtype, cache dtype)``: a bfloat16 cache is attended in
        bfloat16 directly; any other cache is widened to the model's dtype after the gather.
        """
        kvh, hd, grp, b = self.num_kv_heads, self.head_dim, self.group, g.batch_size
        out_dtype = q.dtype
        dtype = attention_dtype(q.dtype, self.k_cache.dtype)
        if g.max_q == 1 and g.context_lens is not None and native.can_use(q, self.k_cache, grp):
            # CPU decode: read K/V blocks in place through the block table (no gathered copy)
            out = native.paged_decode_attention(
                q.view(b, kvh, grp, hd),
                self.k_cache,
                self.v_cache,
                g.block_index.view(b, g.ctx_blocks),
                g.context_lens,
                self.scale,
            )
            return out.reshape(b, self.q_size)
        if g.max_q == 1:  # decode: one query per sequence, the GQA group becomes the rows
            q = q.view(b, kvh, grp, hd).to(dtype)
            step = b
            if not self.k_cache.is_cuda:
                # CPU: gather a few sequences at a time so the copies stay in cache for the kernel
                # (measured ~30% less attention time than one big gather at batch 64, context 512).
                elem = self.k_cache.element_size() + (q.element_size() if dtype != self.k_cache.dtype else 0)
                seq_bytes = 2 * g.ctx_blocks * self.k_cache.shape[2] * kvh * hd * elem
                step = max(1, GATHER_BUDGET_BYTES // seq_bytes)
            outs = []
            for s in range(0, b, step):
                e, nb = min(b, s + step), g.ctx_blocks
                blocks = g.block_index[s * nb : e * nb]
                kc = self._gather(self.k_cache, blocks, e - s, dtype)
                vc = self._gather(self.v_cache, blocks, e - s, dtype)
                bias = None if g.attn_bias is None else g.attn_bias[s:e]
                outs.append(F.scaled_dot_product_attention(q[s:e], kc, vc, attn_mask=bias, scale=self.scale))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            return out.reshape(b, self.q_size).to(out_dtype)
        # one prefill chunk: [n, heads, hd] queries over its context, GQA without copying KV heads
        if native_prefill.can_use(q, self.k_cache, self.v_cache):  # CPU AMX: the paged cache in place
            return native_prefill.paged_prefill_attention(
                q, self.k_cache, self.v_cache, g.block_index, g.q_start, self.scale
            ).to(out_dtype)
        n = g.max_q
        qp = q.to(dtype).transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
        if g.q_start == 0 and k_new is not None:
            kc = k_new.to(dtype).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, hd]
            vc = v_new.to(dtype).transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                qp, kc, vc, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            kc = self._gather(self.k_cache, g.block_index, 1, dtype)[:, :, : g.context]
            vc = self._gather(self.v_cache, g.block_index, 1, dtype)[:, :, : g.context]
            out = F.scaled_dot_product_attention(
                qp, kc, vc, attn_mask=g.attn_bias, scale=self.scale, enable_gqa=True
            )
        return out[0].transpose(0, 1).reshape(n, self.q_size).to(out_dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up)
        if fused.supports(gate_up):  # bf16 on the CPU: one pass, [T, 2I] -> [T, I]
            return linear(fused.silu_and_mul(gate_up), self.down)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return linear(F.silu(gate) * up, self.down)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        h = h + self.attn(self.input_norm(h), meta)
        return h + self.mlp(self.post_attn_norm(h))


class LlamaModel(nn.Module):
    """Llama decoder + LM head. Parameter names are this project's (see ``weights.hf_to_native``)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)
        )
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._packed_embed: torch.Tensor | None = None  # tied LM head in MKL's packed layout
        self._packed_embed_version: int | None = None

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        for layer, k, v in zip(self.layers, k_caches, v_caches, strict=True):
            layer.attn.k_cache, layer.attn.v_cache = k, v

    def decode_attention_pads(self) -> bool:
        """Whether decode attention pads each sequence to its group's longest context (the SDPA path over
        gathered blocks; then :func:`build_step_metadata` should split decodes by context length), or
        runs the native paged kernel, which reads each sequence's own blocks and pads nothing (one group
        of all decodes is best: 1.29x output tokens/s in one pair of runs on a 64-request ShareGPT draw, one
        core)."""
        attn = self.layers[0].attn
        if attn.k_cache is None:
            raise RuntimeError("decode_attention_pads: no KV cache bound (bind_kv_cache first)")
        probe = torch.empty(0, dtype=self.embed.weight.dtype, device=attn.k_cache.device)
        return not native.can_use(probe, attn.k_cache, attn.group)

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for the flattened step (positions come from ``meta``)."""
        freqs = meta.positions.float()[:, None] * self.inv_freq.float()[None, :]
        meta.cos, meta.sin = freqs.cos().to(self.embed.weight.dtype), freqs.sin().to(self.embed.weight.dtype)
        h = self.embed(input_ids)
        if fused.supports(h):
            return self._forward_fused(h, meta)
        for layer in self.layers:
            h = layer(h, meta)
        return h

    def _forward_fused(self, h: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """The layers with each residual add fused into the RMSNorm after it (vLLM's ``fused_add_rms_norm``;
        bf16 on the CPU): ``h`` is the residual stream, updated in place, ``x`` the normed input of the
        next block (one buffer, reused: each block has read it before the next norm writes it). The
        adds round as torch's bf16 adds, so ``h`` is bit-identical to :class:`DecoderLayer`'s."""
        plan = decode_step.decode_plan(self, h, meta)
        if plan is not None:  # an all-decode step: the same kernels with the per-call glue taken out
            return decode_step.run_layers(self, h, plan)
        layers = self.layers
        x = fused.rms_norm(h, layers[0].input_norm.weight, layers[0].input_norm.eps)
        for i, layer in enumerate(layers):
            norm = layer.post_attn_norm
            x = fused.add_rms_norm(h, layer.attn(x, meta), norm.weight, norm.eps, out=x)
            mlp_out = layer.mlp(x)
            if i + 1 == len(layers):
                h.add_(mlp_out)  # the final norm runs in compute_logits, on the rows that sample
            else:
                norm = layers[i + 1].input_norm
                x = fused.add_rms_norm(h, mlp_out, norm.weight, norm.eps, out=x)
        return h

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits for the rows given (apply only to the rows that sample): float32, or with
        ``float32=False`` in the LM head's own dtype (a bf16 model's greedy step needs no widened copy:
        64 x 49k logits are 12.6 MB of float32, ~2.5 ms to write on one core)."""
        h = self.norm(hidden)
        if self.lm_head is not None:
            logits = linear(h, self.lm_head)
        elif self._packed_embed is not None:
            if _version(self.embed.weight) != self._packed_embed_version:
                self._packed_embed, self._packed_embed_version = (
                    _pack(self.embed.weight),
                    _version(self.embed.weight),
                )
            logits = _packed_linear(h, self._packed_embed, self.embed.weight, None)
        else:
            logits = F.linear(h, self.embed.weight)
        return logits.float() if float32 else logits

    def pack_weights_for_cpu(self) -> bool:
        """Pre-pack every matmul weight (and the tied LM head) in MKL's (float32) or oneDNN's (bfloat16)
        GEMM layout; see :func:`linear`.

        Returns False, changing nothing, where that is not available (not a CPU model, a torch without
        MKL, a bfloat16 model on a CPU without native bf16 dot products). The packed copies add the matmul weights' size again in memory. Weights
        changed in place later are re-packed on their next use where torch tracks their version;
        inference-mode tensors do not track it, so whoever overwrites those calls this again.
        """
        if not _can_pack(self.embed.weight):
            return False
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.packed_weight, m.packed_version = _pack(m.weight), _version(m.weight)
        if self.lm_head is None:
            self._packed_embed, self._packed_embed_version = (
                _pack(self.embed.weight),
                _version(self.embed.weight),
            )
        return True
