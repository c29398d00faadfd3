"""The bf16 CPU decode step's layer loop with the per-call Python glue taken out (issue 12).

A decode step of SmolLM2 runs ~150 small C kernels (RoPE, KV write, paged attention, the fused norms,
SiLU-and-mul) between its 120 matmuls. Through the checked wrappers (``fused.py``, ``native.py``) and
``Attention.forward`` each call re-validated shapes, looked its library up, split the QKV output into
three views, allocated its output and read the thread count and the AMX switch again: ~25 us of Python
per layer beyond the kernels. :func:`decode_plan` decides all of that once per step (the step's shapes,
dtypes and libraries are the same in every layer) and :func:`run_layers` then calls the kernels with
raw pointers: q, k and v are addressed inside the QKV rows, the attention output and the SiLU-and-mul
output are one buffer each, reused by every layer (each is read by the next matmul before the next
layer writes it). The kernels, their arguments and their order are those of the general path, so the
hidden states are bit-identical to it (``tests/test_decode_step.py``).

It takes a step only where the general path would run these same kernels: bf16 on the CPU with the
fused library, one decode group covering all rows (every sequence decodes one token), the native
paged-attention and KV-write kernels built for the layer shapes, every layer's caches contiguous and
bf16. Anything else returns None and the model runs its general code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbalance.model import fused, native
from kvbalance.model.packed import linear
from kvbalance.model.step_metadata import StepMetadata


@dataclass(frozen=True)
class DecodePlan:
    """Everything the layers' kernel calls share in one decode step (sizes, pointers, libraries)."""

    rows: int  # T: one token per sequence
    fused_lib: object
    attn_lib: object
    kv_lib: object
    threads: int
    amx: int
    cos_ptr: int
    sin_ptr: int
    cos_stride: int
    slots_ptr: int
    table_ptr: int
    ctx_ptr: int
    max_blocks: int
    cache_slots: int  # num_blocks * block_size
    q_buf: torch.Tensor  # [T, heads * head_dim]: q copied out of the QKV rows (the kernel reads it dense)
    attn_out: torch.Tensor  # [T, heads * head_dim]
    act: torch.Tensor  # [T, intermediate]: SiLU-and-mul output


def _caches_ok(layers, shape: torch.Size) -> bool:
    for layer in layers:
        k, v = layer.attn.k_cache, layer.attn.v_cache
        if k is None or v is None or k.shape != shape or v.shape != shape:
            return False
        if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or not k.is_contiguous():
            return False
        if not v.is_contiguous():
            return False
    return True


def decode_plan(model, h: torch.Tensor, meta: StepMetadata) -> DecodePlan | None:
    """The step's shared kernel arguments, or None where the step is not an all-decode bf16 CPU step
    that the general path would run through the same native kernels."""
    if h.dtype != torch.bfloat16 or len(meta.groups) != 1 or not fused.supports(h) or meta.cos is None:
        return None  # (the fused kernels take float32 rows too, but this loop's buffers are bf16)
    g = meta.groups[0]
    attn0 = model.layers[0].attn
    k0 = attn0.k_cache
    if g.token_index is not None or g.max_q != 1 or g.context_lens is None or k0 is None:
        return None
    if meta.cos.dtype != torch.bfloat16 or k0.dtype != torch.bfloat16 or h.shape[0] != g.batch_size:
        return None
    kvh, num_blocks, block_size, hd = k0.shape
    grp = attn0.group
    probe = h[:1, :1]  # a bf16 CPU tensor: what can_use asks of q
    if not native.can_use(probe, k0, grp) or not _caches_ok(model.layers, k0.shape):
        return None
    kv_lib = native.native_library(1, hd, torch.bfloat16)
    if kv_lib is None:
        return None
    cos, sin = meta.cos, meta.sin
    if cos.shape != (h.shape[0], hd // 2) or cos.stride(1) != 1 or sin.shape != cos.shape:
        return None
    if sin.dtype != torch.bfloat16 or sin.stride() != cos.stride():
        return None
    table, ctx, slots = g.block_index, g.context_lens, meta.slot_mapping
    for x in (table, ctx, slots):
        if x.dtype != torch.int64 or not x.is_contiguous():
            return None
    t = h.shape[0]
    q_size = attn0.q_size
    return DecodePlan(
        rows=t,
        fused_lib=fused.library(),
        attn_lib=native.native_library(grp, hd, torch.bfloat16, torch.bfloat16),
        kv_lib=kv_lib,
        threads=torch.get_num_threads(),
        amx=int(native.has_amx(grp, hd)),
        cos_ptr=cos.data_ptr(),
        sin_ptr=sin.data_ptr(),
        cos_stride=cos.stride(0),
        slots_ptr=slots.data_ptr(),
        table_ptr=table.data_ptr(),
        ctx_ptr=ctx.data_ptr(),
        max_blocks=g.ctx_blocks,
        cache_slots=num_blocks * block_size,
        q_buf=torch.empty(t, q_size, dtype=torch.bfloat16),
        attn_out=torch.empty(t, q_size, dtype=torch.bfloat16),
        act=torch.empty(t, model.layers[0].mlp.intermediate, dtype=torch.bfloat16),
    )


def _check_rows(y: torch.Tensor, t: int, n: int, name: str) -> None:
    # the matmul outputs are dense [T, N]; a kernel given a pointer must not be handed anything else
    if y.shape != (t, n) or y.stride(1) != 1 or y.dtype != torch.bfloat16:
        raise ValueError(
            f"{name}: expected a bf16 [{t}, {n}] with dense rows, got {y.dtype} {tuple(y.shape)}"
        )


def _attention(attn, x: torch.Tensor, p: DecodePlan) -> torch.Tensor:
    """``Attention.forward`` of one decode layer: QKV matmul, RoPE on q and k in place, k/v into the
    cache, paged attention over the cache, the output projection."""
    t, hd, kvh, nh = p.rows, attn.head_dim, attn.num_kv_heads, attn.num_heads
    qkv = linear(x, attn.qkv)
    _check_rows(qkv, t, attn.q_size + 2 * attn.kv_size, "qkv")
    ptr, row = qkv.data_ptr(), qkv.stride(0)
    p.fused_lib.rope(ptr, row, t, nh + kvh, hd, p.cos_ptr, p.sin_ptr, p.cos_stride, p.threads)
    k_ptr = ptr + 2 * attn.q_size  # bf16: 2 bytes an element
    v_ptr = k_ptr + 2 * attn.kv_size
    kc, vc = attn.k_cache.data_ptr(), attn.v_cache.data_ptr()
    p.kv_lib.write_kv(k_ptr, row, v_ptr, row, kc, vc, p.slots_ptr, t, kvh, p.cache_slots)
    p.q_buf.copy_(qkv[:, : attn.q_size])
    p.attn_lib.paged_decode_attention(
        p.q_buf.data_ptr(), kc, vc, p.table_ptr, p.ctx_ptr, p.attn_out.data_ptr(), t, kvh,
        attn.k_cache.shape[1], attn.k_cache.shape[2], p.max_blocks, float(attn.scale), p.threads, p.amx,
    )  # fmt: skip
    return linear(p.attn_out, attn.o)


def _add_rms_norm(h: torch.Tensor, delta: torch.Tensor, norm, out: torch.Tensor, p: DecodePlan) -> None:
    """``fused.add_rms_norm(h, delta, norm.weight, norm.eps, out=out)`` without its checks (h, out are
    the step's own dense [T, hidden] buffers; delta a matmul output checked here)."""
    t, n = h.shape
    _check_rows(delta, t, n, "delta")
    w = norm.weight
    p.fused_lib.add_rms_norm(
        h.data_ptr(), h.stride(0), delta.data_ptr(), delta.stride(0), w.data_ptr(), out.data_ptr(),
        out.stride(0), t, n, norm.eps, p.threads,
    )  # fmt: skip


def run_layers(model, h: torch.Tensor, p: DecodePlan) -> torch.Tensor:
    """``LlamaModel._forward_fused`` for a decode step planned by :func:`decode_plan` (``h`` updated in
    place and returned; the final norm is left to ``compute_logits``)."""
    layers = model.layers
    first = layers[0].input_norm
    norms = [m for layer in layers for m in (layer.input_norm, layer.post_attn_norm)]
    for w in (m.weight for m in norms):
        if w.dtype != torch.bfloat16 or not w.is_contiguous() or w.shape != (h.shape[1],):
            raise ValueError(f"weight: expected a contiguous bfloat16 [{h.shape[1]}], got {tuple(w.shape)}")
    x = fused.rms_norm(h, first.weight, first.eps)
    t, last = p.rows, len(layers) - 1
    for i, layer in enumerate(layers):
        _add_rms_norm(h, _attention(layer.attn, x, p), layer.post_attn_norm, x, p)
        mlp = layer.mlp
        gate_up = linear(x, mlp.gate_up)
        _check_rows(gate_up, t, 2 * mlp.intermediate, "gate_up")
        act = p.act
        p.fused_lib.silu_and_mul(
            gate_up.data_ptr(), gate_up.stride(0), act.data_ptr(), act.stride(0), t, mlp.intermediate,
            p.threads,
        )  # fmt: skip
        down = linear(act, mlp.down)
        if i == last:
            h.add_(down)
        else:
            _add_rms_norm(h, down, layers[i + 1].input_norm, x, p)
    return h
