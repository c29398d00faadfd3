"""Pure formulas for the Elastic KV Cache paper: the prefill activation reserve and its share of memory.

An engine sizes its KV pool after setting aside activation memory for its largest forward pass (vLLM
measures it with a profiling run over `max_num_batched_tokens`). That reserve sits idle while only decodes
run; `elastic.py` lends it to the KV pool and reclaims it before a large prefill. These functions say how
big the reserve is and what share of the memory it could add to the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Attribute names accepted on a model object (kvbalance.specs.ModelSpec uses the first of each), and the
# short keyword aliases accepted as plain ints.
_FIELDS = {
    "num_layers": ("num_layers",),
    "hidden_size": ("hidden_size", "hidden"),
    "num_heads": ("num_heads",),
    "num_kv_heads": ("num_kv_heads",),
    "head_dim": ("head_dim",),
    "intermediate_size": ("intermediate_size", "intermediate"),
    "vocab_size": ("vocab_size", "vocab"),
    "dtype_bytes": ("dtype_bytes",),
}

LOGITS_BYTES = 4  # logits are upcast to fp32 before sampling
DEFAULT_NUM_SAMPLED_TOKENS = 256  # vLLM's default max_num_seqs: its profiling run samples that many rows


@dataclass(frozen=True)
class ModelShape:
    """The model dimensions the reserve and KV-size formulas need (plain ints)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2


def model_shape(model: Any = None, **overrides: int) -> ModelShape:
    """Build a ModelShape from any object with the ModelSpec attribute names, a dict, or keyword ints.

    Keywords win over the object's attributes; `hidden`, `intermediate` and `vocab` are accepted as short
    aliases. `dtype_bytes` defaults to 2 (bf16) when neither gives it.
    """
    values: dict[str, int] = {}
    for field, names in _FIELDS.items():
        value = None
        for name in names:
            if overrides.get(name) is not None:
                value = overrides.pop(name)
                break
        if value is None and model is not None:
            for name in names:
                value = model.get(name) if isinstance(model, dict) else getattr(model, name, None)
                if value is not None:
                    break
        if value is None and field == "dtype_bytes":
            value = 2
        if value is None:
            raise ValueError(f"model shape is missing {field!r}")
        if int(value) != value or value <= 0:
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
        values[field] = int(value)
    known = {name for names in _FIELDS.values() for name in names}
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise TypeError(f"unknown model shape fields: {unknown}")
    return ModelShape(**values)


def _check_tp(tp: int) -> int:
    if int(tp) != tp or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    return int(tp)


def activation_reserve_bytes(
    model: Any = None,
    chunk_size: int = 8192,
    tp: int = 1,
    *,
    num_sampled_tokens: int = DEFAULT_NUM_SAMPLED_TOKENS,
    **shape: int,
) -> int:
    """Peak activation bytes per GPU of one forward pass over `chunk_size` tokens under tensor parallelism.

    Inference frees each layer's activations before the next layer runs, so the peak is one layer's worth
    (num_layers does not enter) on top of the residual stream, or the sampler's logits, whichever is larger.
    With C = chunk_size, h = hidden, H/K = query/KV heads, d = head_dim, I = intermediate, V = vocab,
    e = dtype_bytes and n = min(num_sampled_tokens, C):

      resident = 2 C h e                        residual stream + normed layer input (replicated per rank)
      attn     = C e [(H + 2K)d/tp              fused QKV projection output
                      + (H + K)d/tp             rotary embedding applied out of place to q and k
                      + H d/tp                  attention output (flash attention: no C x C score matrix)
                      + h]                      o_proj output after the all-reduce
      mlp      = C e [2I/tp + I/tp + h]         gate+up output, SiLU(gate)*up, down_proj output
      sampler  = n V (e + 2 * 4)                logits, fp32 upcast and fp32 probabilities (gathered: full V)

      reserve  = resident + max(attn, mlp, sampler)

    Everything alive at the same time inside a phase is counted together, so the estimate errs on the
    large side like vLLM's measured profiling peak. Sharded head counts round up (KV heads fewer than tp
    are replicated). Only the residual stream and the replicated outputs keep the reserve from shrinking
    by exactly tp.
    """
    m = model_shape(model, **shape)
    tp = _check_tp(tp)
    if int(chunk_size) != chunk_size or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer number of tokens, got {chunk_size!r}")
    if num_sampled_tokens < 0:
        raise ValueError(f"num_sampled_tokens must be non-negative, got {num_sampled_tokens!r}")
    c, e = int(chunk_size), m.dtype_bytes
    q_heads, kv_heads = math.ceil(m.num_heads / tp), math.ceil(m.num_kv_heads / tp)
    inter = math.ceil(m.intermediate_size / tp)
    d, h = m.head_dim, m.hidden_size

    resident = 2 * c * h * e
    attn = c * e * ((q_heads + 2 * kv_heads) * d + (q_heads + kv_heads) * d + q_heads * d + h)
    mlp = c * e * (2 * inter + inter + h)
    n = min(int(num_sampled_tokens), c)
    sampler = n * m.vocab_size * (e + 2 * LOGITS_BYTES)
    return resident + max(attn, mlp, sampler)


def kv_bytes_per_token(model: Any = None, tp: int = 1, **shape: int) -> int:
    """KV cache bytes one token takes per GPU: 2 (K and V) * layers * ceil(K/tp) * head_dim * dtype_bytes."""
    m = model_shape(model, **shape)
    tp = _check_tp(tp)
    return 2 * m.num_layers * math.ceil(m.num_kv_heads / tp) * m.head_dim * m.dtype_bytes


def kv_pool_bytes(
    gpu_memory_bytes: int,
    weight_bytes: int,
    reserve_bytes: int,
    gpu_memory_utilization: float = 0.9,
    other_bytes: int = 0,
) -> int:
    """KV pool per GPU = utilisation * GPU memory - weights - activation reserve - other (CUDA graphs, ...)."""
    if gpu_memory_bytes <= 0:
        raise ValueError(f"gpu_memory_bytes must be positive, got {gpu_memory_bytes!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {gpu_memory_utilization!r}")
    for name, v in (
        ("weight_bytes", weight_bytes),
        ("reserve_bytes", reserve_bytes),
        ("other_bytes", other_bytes),
    ):
        if v < 0:
            raise ValueError(f"{name} must be non-negative, got {v!r}")
    pool = int(gpu_memory_utilization * gpu_memory_bytes) - weight_bytes - reserve_bytes - other_bytes
    if pool <= 0:
        raise ValueError(
            f"no memory left for the KV pool: {gpu_memory_utilization} x {gpu_memory_bytes} B minus "
            f"weights {weight_bytes} B, reserve {reserve_bytes} B and other {other_bytes} B is {pool} B"
        )
    return pool


def reserve_share_of_kv(
    gpu_memory_bytes: int,
    weight_bytes: int,
    reserve_bytes: int,
    gpu_memory_utilization: float = 0.9,
    other_bytes: int = 0,
) -> float:
    """reserve / (reserve + KV pool): the fraction of the memory KV could use that the reserve holds back.

    Equivalently the most the KV pool can grow, relative to the elastic total, by lending the reserve.
    """
    pool = kv_pool_bytes(gpu_memory_bytes, weight_bytes, reserve_bytes, gpu_memory_utilization, other_bytes)
    return reserve_bytes / (reserve_bytes + pool)


def lendable_kv_tokens(reserve_bytes: int, model: Any = None, tp: int = 1, **shape: int) -> int:
    """How many extra KV tokens per instance the reserve holds when lent to the pool."""
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be non-negative, got {reserve_bytes!r}")
    return int(reserve_bytes) // kv_bytes_per_token(model, tp, **shape)
