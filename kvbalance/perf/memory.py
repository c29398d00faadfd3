"""Memory formulas, one place for the project: KV bytes per token, the prefill activation reserve, the KV
capacity an engine is left with, and the reserve's share of it (the Elastic KV Cache paper's quantities).

An engine sizes its KV pool after setting aside activation memory for its largest forward pass (vLLM
measures it with a profiling run over ``max_num_batched_tokens``). That reserve sits idle while only decodes
run; ``kvcache/elastic.py`` lends it to the KV pool and reclaims it before a large prefill. Every function
takes a :class:`~kvbalance.specs.ModelSpec` (names resolve to specs at the edges, ``get_model``).
"""

from __future__ import annotations

import math

from kvbalance.specs import HardwareSpec, ModelSpec, get_gpu, get_model

LOGITS_BYTES = 4  # logits are upcast to fp32 before sampling
DEFAULT_NUM_SAMPLED_TOKENS = 256  # vLLM's default max_num_seqs: its profiling run samples that many rows


def _check_tp(tp: int) -> int:
    if isinstance(tp, bool) or int(tp) != tp or tp < 1:
        raise ValueError(f"tp: must be a positive integer, got {tp!r}")
    return int(tp)


def validate_tp(model: ModelSpec, tp: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp: must be a positive integer, got {tp!r}")
    if model.num_heads % tp:
        raise ValueError(f"tp: {tp} does not divide num_heads {model.num_heads} of {model.name}")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ValueError(
            f"tp: {tp} neither divides nor is a multiple of num_kv_heads {model.num_kv_heads} of {model.name}"
        )
    if model.intermediate_size % tp:
        raise ValueError(
            f"tp: {tp} does not divide intermediate_size {model.intermediate_size} of {model.name}"
        )


def kv_bytes_per_token(model: ModelSpec, tp: int = 1) -> int:
    """KV cache bytes one token takes per GPU: 2 (K and V) * layers * ceil(K / tp) * head_dim * dtype_bytes
    (KV heads fewer than tp are replicated)."""
    return model.kv_bytes_per_gpu(_check_tp(tp))


def activation_reserve_bytes(
    model: ModelSpec,
    chunk_size: int = 8192,
    tp: int = 1,
    *,
    num_sampled_tokens: int = DEFAULT_NUM_SAMPLED_TOKENS,
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
    m = model
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


def engine_activation_reserve_bytes(
    model: ModelSpec, tp: int = 1, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256
) -> int:
    """The reserve an engine with this token budget and sequence cap sets aside (its sampler samples up to
    ``min(max_num_seqs, max_num_batched_tokens)`` rows)."""
    return activation_reserve_bytes(
        model, max_num_batched_tokens, tp, num_sampled_tokens=min(max_num_seqs, max_num_batched_tokens)
    )


def kv_capacity_tokens(
    model: ModelSpec | str,
    gpu: HardwareSpec | str,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int | None = None,
) -> int:
    """Tokens of KV that fit on each GPU: (capacity * util - weights / tp - reserve) / (kv bytes per token / tp)."""
    m, g = get_model(model), get_gpu(gpu)
    validate_tp(m, tp)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
    reserve = (
        engine_activation_reserve_bytes(m, tp)
        if activation_reserve_bytes is None
        else activation_reserve_bytes
    )
    if reserve < 0:
        raise ValueError(f"activation_reserve_bytes: must be >= 0, got {reserve}")
    budget = g.mem_capacity_bytes * gpu_memory_utilization
    weights = m.weight_bytes / tp
    free = budget - weights - reserve
    if free <= 0:
        gib = 1 << 30
        raise ValueError(
            f"tp: {m.name} needs {weights / gib:.1f} GiB of weights per GPU at tp={tp} plus "
            f"{reserve / gib:.1f} GiB activation reserve, but {g.name} offers {budget / gib:.1f} GiB "
            f"at gpu_memory_utilization={gpu_memory_utilization}; raise tp or pick a bigger GPU"
        )
    return int(free // kv_bytes_per_token(m, tp))


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


def lendable_kv_tokens(reserve_bytes: int, model: ModelSpec, tp: int = 1) -> int:
    """How many extra KV tokens per instance the reserve holds when lent to the pool."""
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be non-negative, got {reserve_bytes!r}")
    return int(reserve_bytes) // kv_bytes_per_token(model, tp)
