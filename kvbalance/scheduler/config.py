"""The scheduler's typed config: the per-step token budget, the sequence cap, prefix caching (and how blocks
are named: ``prefix_caching_hash_algo``, vLLM's name, and a per-deployment salt), the admission watermark
and the policy's name (one of :data:`~kvbalance.scheduler.base.POLICIES`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbalance.kvcache.hashing import DEFAULT_HASH_ALGO, BlockHasher
from kvbalance.scheduler.base import POLICIES


@dataclass
class SchedulerConfig:
    """Batching knobs. ``max_num_batched_tokens`` is the per-step token budget (Sarathi's chunk size).

    ``prefix_caching_hash_algo`` names KV blocks: ``sha256`` (default) or ``blake2b`` (keyed by the salt)
    for anything that computes real KV; ``poly64``, the fast non-cryptographic hash, only where hits are
    merely counted (simulation). ``prefix_caching_salt`` and ``prefix_caching_model`` (the model whose KV is
    cached) enter every block's hash: blocks of another deployment or model never match.
    """

    policy: str = "sarathi"  # a name in POLICIES
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # share of blocks kept free at admission, so new requests do not preempt at once
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO  # one of kvcache.hashing.HASH_ALGOS
    prefix_caching_salt: str = ""
    prefix_caching_model: str = ""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES.names())}, got {self.policy!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark: must be in [0, 1), got {self.watermark}")
        self.block_hasher()  # names the bad field (algo, salt, model) now rather than at the first request

    def block_hasher(self) -> BlockHasher:
        """The hasher that names this scheduler's KV blocks."""
        return BlockHasher(self.prefix_caching_hash_algo, self.prefix_caching_salt, self.prefix_caching_model)
