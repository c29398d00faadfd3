"""The scheduler's typed config: the per-step token budget, the sequence cap, prefix caching, the admission
watermark and the policy's name (one of :data:`~kvbalance.scheduler.base.POLICIES`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbalance.scheduler.base import POLICIES


@dataclass
class SchedulerConfig:
    """Batching knobs. ``max_num_batched_tokens`` is the per-step token budget (Sarathi's chunk size)."""

    policy: str = "sarathi"  # a name in POLICIES
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # share of blocks kept free at admission, so new requests do not preempt at once

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES.names())}, got {self.policy!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark: must be in [0, 1), got {self.watermark}")
