"""``cache_aware``: sgl-router's cache-aware load balancer over an approximate prefix tree per instance.

Rule (sgl-router ``CacheAwarePolicy``): load = requests queued or running on the instance. The system is
imbalanced when ``max_load - min_load > balance_abs_threshold`` AND ``max_load > balance_rel_threshold x
min_load``; then the request goes to the least loaded instance. Otherwise the instance whose tree matches the
longest prefix wins when its match rate (matched prompt tokens / prompt tokens) exceeds ``cache_threshold``;
on a miss the instance with the smallest tree (most free cache, as the router guesses). Either way the prompt
is inserted into the chosen instance's tree. Defaults are what sgl-router's Python launcher passes
(``router_args.py``: 0.3 / 64 / 1.5); ``RUST_DEFAULTS`` are the Rust ``CacheAwareConfig`` defaults.
Trees here are kept per KV block (``prefix_index.ApproxPrefixIndex``), not per character.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbalance.cluster.routers.base import ROUTERS, Router, argmin, load_keys
from kvbalance.cluster.routers.prefix_index import ApproxPrefixIndex
from kvbalance.engine import InstanceLoad
from kvbalance.request import Request


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size_tokens: int | None = 1 << 26

    def __post_init__(self) -> None:
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold: must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold: must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1:
            raise ValueError(f"balance_rel_threshold: must be >= 1, got {self.balance_rel_threshold}")


PYTHON_LAUNCHER_DEFAULTS = CacheAwareConfig()
RUST_DEFAULTS = CacheAwareConfig(cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.1)
PRESETS = {"python": PYTHON_LAUNCHER_DEFAULTS, "rust": RUST_DEFAULTS}


def is_imbalanced(loads: Sequence[int], abs_threshold: float, rel_threshold: float) -> bool:
    """sgl-router's imbalance test: both the absolute and the relative gap exceed their thresholds."""
    hi, lo = max(loads), min(loads)
    return hi - lo > abs_threshold and hi > rel_threshold * lo


@ROUTERS.register("cache_aware")
class CacheAwareRouter(Router):
    def __init__(self, block_size: int = 16, preset: str = "python", **overrides) -> None:
        super().__init__(block_size)
        if preset not in PRESETS:
            raise ValueError(f"preset: unknown {preset!r} (known: {', '.join(PRESETS)})")
        base = PRESETS[preset]
        self.config = CacheAwareConfig(**{**base.__dict__, **overrides})
        self.trees: dict[object, ApproxPrefixIndex] = {}  # instance key (``load_keys``) -> its tree
        self.last_decision = ""  # "imbalanced", "hit" or "miss": for tests and reports

    def _tree(self, key: object) -> ApproxPrefixIndex:
        if key not in self.trees:
            self.trees[key] = ApproxPrefixIndex(self.block_size, self.config.max_tree_size_tokens)
        return self.trees[key]

    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        cfg = self.config
        n = len(loads)
        trees = [self._tree(k) for k in load_keys(loads)]
        hashes = trees[0].prompt_hashes(req)
        load = [ld.num_waiting + ld.num_loading + ld.num_running for ld in loads]
        if is_imbalanced(load, cfg.balance_abs_threshold, cfg.balance_rel_threshold):
            choice, self.last_decision = argmin(load), "imbalanced"
        else:
            matched = [t.match_blocks(hashes) for t in trees]
            best = max(range(n), key=lambda i: (matched[i], -i))
            rate = matched[best] * self.block_size / req.num_prompt_tokens
            if rate > cfg.cache_threshold:
                choice, self.last_decision = best, "hit"
            else:
                choice, self.last_decision = argmin([t.size_tokens for t in trees]), "miss"
        trees[choice].insert(hashes)
        return choice
