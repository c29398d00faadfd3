"""KV-cache capacity and activation-reserve arithmetic: how many tokens of KV fit on each GPU once the
weights and one forward pass's activations are placed.
"""

from __future__ import annotations

from kvbalance.specs import HardwareSpec, ModelSpec, get_gpu, get_model


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


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads each TP rank stores (replicated when there are fewer KV heads than ranks)."""
    return max(model.num_kv_heads // tp, 1)


def kv_bytes_per_token_per_gpu(model: ModelSpec, tp: int = 1) -> int:
    return 2 * model.num_layers * kv_heads_per_rank(model, tp) * model.head_dim * model.dtype_bytes


def activation_reserve_bytes(
    model: ModelSpec | str, tp: int = 1, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256
) -> int:
    """Peak activation memory of one forward pass at the token budget (what a serving engine profiles).

    One formula for the whole project: :func:`kvbalance.kvcache.elastic_reserve.activation_reserve_bytes`
    (one layer's live tensors or the sampler's fp32 logits for up to ``max_num_seqs`` rows, whichever peaks).
    """
    from kvbalance.kvcache import elastic_reserve

    m = get_model(model)
    validate_tp(m, tp)
    return elastic_reserve.activation_reserve_bytes(
        m, max_num_batched_tokens, tp, num_sampled_tokens=min(max_num_seqs, max_num_batched_tokens)
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
    reserve = _default_reserve(m, tp) if activation_reserve_bytes is None else activation_reserve_bytes
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
    return int(free // kv_bytes_per_token_per_gpu(m, tp))


def _default_reserve(m: ModelSpec, tp: int) -> int:
    return activation_reserve_bytes(m, tp)
