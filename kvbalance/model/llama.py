"""A Llama-architecture decoder in plain PyTorch that computes one step over a paged KV cache.

One forward runs a flattened mix of prefill chunks and decodes (tokens of all sequences
concatenated). Each layer writes the new tokens' K/V into their cache slots (one
``index_copy_`` over the step's slot mapping), gathers each sequence's context by whole blocks
through its block table into a padded batch, and runs ``scaled_dot_product_attention`` per
attention group (decodes, split by context length, and prefill chunks). The per-step
bookkeeping (slot mapping, gather indices, masks, RoPE angles) lives in :class:`StepMetadata`,
built once per step and shared by all layers, so ``forward(input_ids, meta)`` stays plain.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvbalance.model import fused, native
from kvbalance.model.packed import _can_pack, _pack, _packed_linear, _version, linear
from kvbalance.model.packed import native_bf16_matmul as native_bf16_matmul  # re-exported

LLAMA_LIKE_ARCHS = ("llama", "qwen2", "mistral", "smollm", "smollm2")
GATHER_BUDGET_BYTES = 4 << 20  # CPU decode: gathered K+V per attention call, sized to stay in cache


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama-architecture model (field names follow ``ModelSpec``)."""

    name: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    max_context: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF style: {"rope_type": "llama3" | "linear", "factor": ..., ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # HF Llama's ``attention_bias`` biases o_proj too; Qwen2 biases only q/k/v
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str | None = None  # the checkpoint's ``torch_dtype`` ("bfloat16", "float32", ...); None: not given

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}: must be >= 1, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} must divide num_heads {self.num_heads} (grouped-query attention)"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim: must be even and >= 2 for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise ValueError(f"rope_scaling: type {kind!r} not supported (default, linear, llama3)")

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_spec(cls, spec) -> LlamaConfig:
        """Build from anything with ``ModelSpec``'s field names (duck-typed, so no import of specs)."""
        arch = str(getattr(spec, "arch", "llama") or "llama").lower()
        if arch not in LLAMA_LIKE_ARCHS:
            raise ValueError(
                f"arch: {arch!r} is not a Llama-architecture model ({', '.join(LLAMA_LIKE_ARCHS)})"
            )
        heads = int(spec.num_heads)
        head_dim = getattr(spec, "head_dim", None) or spec.hidden_size // heads
        qkv_bias = bool(getattr(spec, "qkv_bias", False))
        return cls(
            name=str(getattr(spec, "name", arch)),
            vocab_size=int(spec.vocab_size),
            hidden_size=int(spec.hidden_size),
            intermediate_size=int(spec.intermediate_size),
            num_layers=int(spec.num_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(spec, "num_kv_heads", None) or heads),
            head_dim=int(head_dim),
            max_context=int(getattr(spec, "max_context", 4096) or 4096),
            rms_norm_eps=float(getattr(spec, "rms_norm_eps", 1e-5) or 1e-5),
            rope_theta=float(getattr(spec, "rope_theta", 10000.0) or 10000.0),
            rope_scaling=_rope_scaling_or_none(getattr(spec, "rope_scaling", None)),
            tie_word_embeddings=bool(getattr(spec, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=qkv_bias and bool(getattr(spec, "linear_bias", False)),
            bos_token_id=getattr(spec, "bos_token_id", None),
            eos_token_id=getattr(spec, "eos_token_id", None),
        )

    @classmethod
    def from_hf_config(cls, d: dict) -> LlamaConfig:
        """Build from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2; transformers 4 or 5 keys)."""
        model_type = str(d.get("model_type", "llama")).lower()
        if model_type not in LLAMA_LIKE_ARCHS:
            raise ValueError(f"model_type: {model_type!r} is not a Llama-architecture model")
        heads = int(d["num_attention_heads"])
        rope_params = dict(d.get("rope_parameters") or {})
        theta = d.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or rope_params or None
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            name=str(d.get("_name_or_path") or model_type),
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            max_context=int(d.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=_rope_scaling_or_none(scaling),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            dtype=_dtype_name(d.get("torch_dtype") or d.get("dtype")),
        )

    def to_hf_config(self) -> dict:
        """A ``config.json``-style dict for ``transformers.LlamaConfig`` (tests, saving)."""
        if self.qkv_bias != self.o_bias:
            raise ValueError("qkv_bias: HF Llama biases q/k/v/o together; this config differs (Qwen2-style)")
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
            rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_context,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }

    def to_dict(self) -> dict:
        return asdict(self)


def _dtype_name(dtype) -> str | None:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` -> ``"bfloat16"`` (None stays None)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _rope_scaling_or_none(scaling) -> dict | None:
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("type", None) or scaling.get("rope_type", "default")
    scaling["rope_type"] = kind
    scaling.pop("rope_theta", None)
    return None if kind == "default" and len(scaling) == 1 else scaling


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim / 2] in float32, with ``linear`` or ``llama3`` scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend linearly in wavelength between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling.get("original_max_position_embeddings", config.max_context))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(middle, blended, inv_freq)
    return inv_freq


def attention_dtype(model_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """Dtype attention runs in: bfloat16 caches natively (the CPU kernel is ~2x faster than
    widening them), other narrow caches (float16) widened to the model's dtype after the gather."""
    return cache_dtype if cache_dtype == torch.bfloat16 else model_dtype


# -- per-step metadata ----------------------------------------------------------------------------


@dataclass
class AttnGroup:
    """Sequences whose attention runs as one padded ``scaled_dot_product_attention`` call.

    Decodes (one query each) and prefill chunks form separate groups, and decodes of very
    different context lengths are split further, so no group pads much work it does not need.
    """

    token_index: torch.Tensor | None  # [n] rows of the step's T tokens (None: all T rows, in order)
    block_index: torch.Tensor  # [B * ctx_blocks] physical blocks to gather, row-major per sequence
    attn_bias: torch.Tensor | None  # [B, 1, G * max_q, ctx_blocks * block_size] additive mask (0 / -inf)
    query_index: torch.Tensor | None  # [B * max_q] group token for each padded query (None: decode group)
    output_index: torch.Tensor | None  # [n] padded query row of each group token (None: decode group)
    batch_size: int
    max_q: int
    ctx_blocks: int
    context_lens: torch.Tensor | None = None  # [B] int64 keys per sequence (decode groups: native kernel)
    q_start: int = 0  # prefill groups (one sequence each): position of the first new token
    context: int = 0  # prefill groups: keys the last new token attends (q_start + new tokens)


@dataclass
class StepMetadata:
    """Everything attention needs for one step, computed once and shared by all layers.

    Tokens of all sequences are concatenated (``T`` rows, the plan's order).
    """

    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) of each new token
    logits_indices: torch.Tensor  # [S] rows of T that sample
    groups: list[AttnGroup]
    query_start_loc: np.ndarray  # [B + 1] cumulative new-token counts (host side, for inspection)
    context_lens: np.ndarray  # [B] tokens whose KV exists after the step
    cos: torch.Tensor | None = None  # [T, head_dim / 2], filled by the model (in its dtype)
    sin: torch.Tensor | None = None


def _split_decodes(
    ctx: np.ndarray, rows: np.ndarray, block_size: int, max_groups: int = 4
) -> list[np.ndarray]:
    """Split decode rows (sorted by context) into at most ``max_groups`` equal-count groups when
    that cuts padded context enough to pay for the extra calls (``block_size`` per call per seq)."""
    if len(rows) < 8:
        return [rows]
    order = rows[np.argsort(ctx[rows], kind="stable")]
    best, best_cost = [rows], None
    for k in range(1, max_groups + 1):
        parts = [p for p in np.array_split(order, k) if len(p)]
        cost = sum(len(p) * int(ctx[p].max()) for p in parts) + (k - 1) * len(rows) * block_size
        if best_cost is None or cost < 0.9 * best_cost:
            best, best_cost = parts, cost
    return [np.sort(p) for p in best]


def build_step_metadata(
    seq_starts: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    sample_rows: list[int],
    block_size: int,
    group_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> StepMetadata:
    """Vectorised (numpy) construction of the step's index tensors.

    ``seq_starts[b]``: first new position of sequence b; ``seq_lens[b]``: its new tokens;
    ``block_tables[b]``: its physical block ids; ``sample_rows``: indices b that sample.
    ``group_size`` is query heads per KV head (masks are laid out for folded GQA queries).
    """

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    b = len(seq_starts)
    starts = np.asarray(seq_starts, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    ctx = starts + lens
    num_tokens = int(lens.sum())
    nblocks = (ctx + block_size - 1) // block_size
    table = np.zeros((b, int(nblocks.max())), dtype=np.int64)
    for i, ids in enumerate(block_tables):
        if len(ids) < nblocks[i]:
            raise ValueError(
                f"block_ids: sequence {i} has {len(ids)} blocks of {block_size}, needs {int(ctx[i])} tokens"
            )
        table[i, : nblocks[i]] = ids[: nblocks[i]]
    cu = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    seq_of_token = np.repeat(np.arange(b), lens)
    offset_in_seq = np.arange(num_tokens) - cu[:-1][seq_of_token]
    positions = starts[seq_of_token] + offset_in_seq
    slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size

    is_decode = lens == 1
    row_sets = _split_decodes(ctx, np.flatnonzero(is_decode), block_size) if is_decode.any() else []
    groups = []
    only_group = len(row_sets) + int((~is_decode).sum()) == 1
    for rows in row_sets:
        g_ctx = ctx[rows]
        nb = int(nblocks[rows].max())
        key_valid = np.arange(nb * block_size)[None, :] < g_ctx[:, None]  # [Bg, Lp]
        mask = key_valid[:, None, None, :]
        bias = None if mask.all() else t(np.where(mask, np.float32(0.0), np.float32(-np.inf))).to(dtype)
        groups.append(
            AttnGroup(
                token_index=None if only_group else t(cu[rows]),
                block_index=t(table[rows, :nb].reshape(-1)),
                attn_bias=bias,
                query_index=None,
                output_index=None,
                batch_size=len(rows),
                max_q=1,
                ctx_blocks=nb,
                context_lens=t(g_ctx),
            )
        )
    # Prefill chunks: one attention call each (no padding across sequences). A chunk without cached
    # prefix attends only its own new keys, causally; a chunk after a prefix gets a bottom-right mask.
    for r in np.flatnonzero(~is_decode):
        n, st, c = int(lens[r]), int(starts[r]), int(ctx[r])
        bias = None
        if st > 0:
            allowed = np.arange(c)[None, :] <= (st + np.arange(n))[:, None]
            bias = t(np.where(allowed, np.float32(0.0), np.float32(-np.inf))).to(dtype)
        groups.append(
            AttnGroup(
                token_index=None if only_group else t(np.arange(cu[r], cu[r + 1])),
                block_index=t(table[r, : int(nblocks[r])]),
                attn_bias=bias,
                query_index=None,
                output_index=None,
                batch_size=1,
                max_q=n,
                ctx_blocks=int(nblocks[r]),
                q_start=st,
                context=c,
            )
        )
    logits_rows = cu[1:][np.asarray(sample_rows, dtype=np.int64)] - 1
    return StepMetadata(
        positions=t(positions),
        slot_mapping=t(slots),
        logits_indices=t(logits_rows),
        groups=groups,
        query_start_loc=cu,
        context_lens=ctx,
    )


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
        if meta.cos.dtype == torch.bfloat16 and fused.supports(qkv):  # bf16 on the CPU: in place
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
