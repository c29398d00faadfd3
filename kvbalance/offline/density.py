"""Compute density (BlendServe section 3): how compute- or memory-heavy a request, a subtree or a job is.

For a request with prompt p and output d (the paper's definitions; the cost model supplies the constants):

    Comp(r) = [2 (p + d) P_model + 4 p^2 H L] / F        (GEMMs over every token + causal prefill attention)
    Mem(r)  = (p d + d^2 / 2) * kv_bytes_per_token / B   (decode attention re-reads the growing KV each step)
    rho(r)  = Comp(r) / Mem(r)

with P_model the parameter count, H the hidden size, L the layers, kv_bytes_per_token = 2 H_kv L x bytes
(K and V), F the achievable FLOP/s and B the achievable bandwidth of all ``tp`` GPUs of a replica. A set of
requests sharing prefixes computes the shared part once: rho = (1 - s) T_comp / T_mem with s the prefix-
sharing ratio (share of prompt tokens served from the cache). The ideal bound of a job is
max((1 - s_opt) T_comp, T_mem), s_opt the DFS sharing ratio (every shared prefix computed once); the paper calls
it impractical and measures against a practical optimum instead (``optimum.py``).
rho > 1: compute-bound work dominates; rho < 1: memory-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbalance.perf.cost import CostModel


@dataclass(frozen=True)
class DensityConstants:
    """The constants of Comp and Mem for one replica. ``flops_per_s`` and ``bytes_per_s`` are achievable
    rates summed over the replica's GPUs (peak x the cost model's saturated efficiency)."""

    num_params: float
    hidden_size: int
    num_layers: int
    kv_bytes_per_token: float
    flops_per_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        for f in (
            "num_params",
            "hidden_size",
            "num_layers",
            "kv_bytes_per_token",
            "flops_per_s",
            "bytes_per_s",
        ):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f}: must be > 0, got {getattr(self, f)!r}")

    @classmethod
    def from_cost_model(cls, cm: CostModel) -> DensityConstants:
        m, g, tp = cm.model, cm.gpu, cm.tp
        return cls(
            num_params=float(m.num_params),
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            kv_bytes_per_token=float(m.kv_bytes_per_token),
            flops_per_s=g.peak_flops * g.compute_eff_max * tp,
            bytes_per_s=g.mem_bandwidth_bytes_s * g.memory_eff_max * g.kv_memory_eff_ratio * tp,
        )

    @classmethod
    def for_model(cls, model: str, gpu: str, tp: int = 1) -> DensityConstants:
        return cls.from_cost_model(CostModel(model, gpu, tp))


def comp_s(p, d, k: DensityConstants):
    """Comp(r) in seconds (scalars or numpy arrays)."""
    p = np.asarray(p, dtype=np.float64)
    d = np.asarray(d, dtype=np.float64)
    return (2.0 * (p + d) * k.num_params + 4.0 * p * p * k.hidden_size * k.num_layers) / k.flops_per_s


def mem_s(p, d, k: DensityConstants):
    """Mem(r) in seconds (scalars or numpy arrays)."""
    p = np.asarray(p, dtype=np.float64)
    d = np.asarray(d, dtype=np.float64)
    return (p * d + d * d / 2.0) * k.kv_bytes_per_token / k.bytes_per_s


def compute_density(p, d, k: DensityConstants):
    """rho(r) = Comp(r) / Mem(r) for prompt ``p`` and output ``d`` >= 1 tokens."""
    d = np.asarray(d, dtype=np.float64)
    if np.any(d < 1):
        raise ValueError("d: output lengths must be >= 1 token")
    return comp_s(p, d, k) / mem_s(p, d, k)


def group_density(total_comp_s: float, total_mem_s: float, sharing: float) -> float:
    """rho of a set of requests: (1 - s) T_comp / T_mem (BlendServe's node density)."""
    if not 0 <= sharing <= 1:
        raise ValueError(f"sharing: must be in [0, 1], got {sharing}")
    if total_mem_s <= 0:
        return float("inf")
    return (1.0 - sharing) * total_comp_s / total_mem_s


def ideal_bound_s(total_comp_s: float, total_mem_s: float, dfs_sharing: float) -> float:
    """The ideal bound max((1 - s_opt) T_comp, T_mem) (no weight reads, saturated kernels, no host time)."""
    if not 0 <= dfs_sharing <= 1:
        raise ValueError(f"dfs_sharing: must be in [0, 1], got {dfs_sharing}")
    return max((1.0 - dfs_sharing) * total_comp_s, total_mem_s)


def job_density_fn(k: DensityConstants):
    """rho of a job from its lengths and sharing ratio: (1 - s) sum Comp / sum Mem (for the job tuner)."""

    def density_of(prompt_lens, output_lens, sharing: float) -> float:
        return group_density(
            float(comp_s(prompt_lens, output_lens, k).sum()),
            float(mem_s(prompt_lens, output_lens, k).sum()),
            sharing,
        )

    return density_of
