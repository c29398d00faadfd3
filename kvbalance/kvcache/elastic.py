"""Elastic KV reserve (Elastic KV Cache paper): lend the prefill activation reserve to the KV pool while only
decodes run, and reclaim it before a prefill needs it; plus the static overcommit it is compared with.

An engine sets aside activation memory for its largest prefill chunk (``perf/memory.py`` sizes it).
While every running request decodes, a step needs only a decode batch's activations, so the rest of the
reserve — ``reserve_blocks`` KV blocks, the region ``[base, base + E)`` of an :class:`ElasticBlockPool` —
can hold KV. :class:`ElasticReserve` decides, before each step, and returns the decision as a
:class:`ReserveSwitch` for its caller (the instance) to carry out with the scheduler; it never calls
into the scheduler itself:

* lend: the next batch is decode-only (nothing waits, no running prompt is unfinished) -> attach the
  region (its blocks join the free list; base blocks are still handed out first) and close admission;
* reclaim: a request waits (a new prompt, or one preempted for lack of memory) -> drain the region and
  detach it, then reopen admission. Draining needs the running requests that hold a lent block
  preempted (the switch lists them; they resume by recompute; their KV is never overwritten in place)
  and evicts lent blocks the prefix cache still holds (with their descendants, whose prefixes include
  them).

Mapping and unmapping are not free: with CUDA virtual memory management the region is mapped in 2 MiB
granules (cuMemMap / cuMemUnmap plus cuMemSetAccess). We model ``map_fixed_s + GiB * map_s_per_gib``
each way with 2 ms/GiB (about 4 us per granule) and 0.1 ms fixed by default — "milliseconds each way"
for GiB-sized reserves, as the paper reports. This is an assumption to vary, not a measurement. The
engine adds it to the step that follows the switch (``StepBreakdown.overhead_s``).

Static overcommit gives the region to the pool for good. Physical pages are only consumed as KV is
written, so it works until a step needs more activation memory than is left:
``activation_bytes(step tokens) > reserve_bytes - max(0, used - base) * block_bytes`` -> CUDA OOM. The
engine then fails the instance: every request it holds is rejected with reason ``"oom"``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kvbalance.kvcache.blocks import BlockPool, ElasticBlockPool
from kvbalance.kvcache.prefix import RadixCache
from kvbalance.perf import memory
from kvbalance.request import Request
from kvbalance.specs import ModelSpec

GIB = 1 << 30
OOM = "oom"


@dataclass
class ElasticConfig:
    """The reserve's lendable part in KV blocks and how lending behaves.

    ``reserve_bytes`` is the whole activation reserve (default ``reserve_blocks * block_bytes``);
    ``activation_bytes(n)`` is the activation peak of a step of ``n`` tokens (static mode's OOM check;
    without it a step needs ``reserve_bytes`` when it computes prompt tokens, else nothing).
    ``lend_min_used_fraction``: lend only once the base pool is at least this full (0 = always).
    """

    reserve_blocks: int
    block_bytes: int
    mode: Literal["elastic", "static"] = "elastic"
    reserve_bytes: int | None = None
    activation_bytes: Callable[[int], int] | None = None
    map_s_per_gib: float = 0.002
    unmap_s_per_gib: float = 0.002
    map_fixed_s: float = 0.0001
    lend_min_used_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("elastic", "static"):
            raise ValueError(f"mode: must be 'elastic' or 'static', got {self.mode!r}")
        if self.reserve_blocks < 0:
            raise ValueError(f"reserve_blocks: must be >= 0, got {self.reserve_blocks}")
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes: must be >= 1, got {self.block_bytes}")
        for name in ("map_s_per_gib", "unmap_s_per_gib", "map_fixed_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.lend_min_used_fraction <= 1:
            raise ValueError(f"lend_min_used_fraction: must be in [0, 1], got {self.lend_min_used_fraction}")
        if self.reserve_bytes is None:
            self.reserve_bytes = self.reserve_blocks * self.block_bytes
        if self.reserve_bytes < self.reserve_blocks * self.block_bytes:
            raise ValueError(
                f"reserve_bytes: {self.reserve_bytes} is less than the lent region "
                f"({self.reserve_blocks} blocks x {self.block_bytes} B)"
            )

    @property
    def region_bytes(self) -> int:
        return self.reserve_blocks * self.block_bytes

    def map_s(self) -> float:
        return self.map_fixed_s + self.region_bytes / GIB * self.map_s_per_gib

    def unmap_s(self) -> float:
        return self.map_fixed_s + self.region_bytes / GIB * self.unmap_s_per_gib

    @classmethod
    def for_model(
        cls,
        model,
        chunk_size: int,
        tp: int = 1,
        block_size: int = 16,
        max_num_seqs: int = 256,
        mode: Literal["elastic", "static"] = "elastic",
        **kwargs,
    ) -> ElasticConfig:
        """The reserve of ``chunk_size``-token prefills (``perf/memory.py`` formulas); what a decode-only
        step of up to ``max_num_seqs`` tokens needs stays reserved, the rest becomes lendable blocks."""
        reserve = memory.activation_reserve_bytes(model, chunk_size, tp)
        keep = memory.activation_reserve_bytes(model, min(max_num_seqs, chunk_size), tp)
        block_bytes = memory.kv_bytes_per_token(model, tp) * block_size
        return cls(
            reserve_blocks=max(0, reserve - keep) // block_bytes,
            block_bytes=block_bytes,
            mode=mode,
            reserve_bytes=reserve,
            activation_bytes=functools.partial(_step_activation_bytes, model, tp),
            **kwargs,
        )


def _step_activation_bytes(model: ModelSpec, tp: int, num_tokens: int) -> int:
    return memory.activation_reserve_bytes(model, max(int(num_tokens), 1), tp)


def evict_cached_blocks(cache: RadixCache, block_ids: Sequence[int]) -> int:
    """Drop the given blocks (and every cached block below them) from the prefix cache; see
    :meth:`RadixCache.evict_blocks`."""
    return cache.evict_blocks(block_ids)


@dataclass(frozen=True)
class ReserveSwitch:
    """What the reserve asks of its caller before a step: preempt the requests in ``preempt`` (running
    requests that hold a lent block, newest first, so the oldest ends up at the head of the queue), then
    :meth:`ElasticReserve.apply` the switch, then set the scheduler's admission to ``admission_open``
    (None: leave it). ``action`` None: nothing to do."""

    action: Literal["lend", "reclaim"] | None = None
    preempt: tuple[Request, ...] = ()
    admission_open: bool | None = None


NO_SWITCH = ReserveSwitch()


class ElasticReserve:
    """Lends the reserve region to the pool during decode-only periods and reclaims it (see the module doc).

    It holds the pool and the prefix cache, not the scheduler: :meth:`before_step` returns a
    :class:`ReserveSwitch` (what to preempt, whether admission closes or reopens) that the caller carries
    out and hands back to :meth:`apply`. In static mode the pool is a plain :class:`BlockPool` of
    ``base_blocks + reserve_blocks`` blocks and nothing is ever switched.
    """

    def __init__(
        self, config: ElasticConfig, pool: BlockPool, cache: RadixCache | None, base_blocks: int
    ) -> None:
        if config.mode == "elastic" and not isinstance(pool, ElasticBlockPool):
            raise TypeError("pool: elastic mode needs an ElasticBlockPool")
        self.config = config
        self.pool = pool
        self.cache = cache
        self.base_blocks = base_blocks
        self.lent = False
        self._lent_since = 0.0
        self._region = list(pool.elastic_block_ids()) if isinstance(pool, ElasticBlockPool) else []
        if self._region and cache is not None:
            pool.evict_before_lent = cache.evict  # idle cached prefixes give way before lent blocks are used
        # counters
        self.num_lends = 0
        self.num_reclaims = 0
        self.drain_preemptions = 0  # requests preempted because they held a lent block
        self.drain_evicted_blocks = 0  # cached blocks dropped to empty the region
        self.switch_s = 0.0  # modelled map + unmap time
        self.lent_s = 0.0  # time the region was lent (closed periods)
        self.peak_capacity_tokens = pool.capacity_tokens

    # -- policy -------------------------------------------------------------------------------
    def before_step(self, running: Sequence[Request], waiting: bool, has_prefill_work: bool) -> ReserveSwitch:
        """Whether to lend or reclaim before the scheduler plans the next step, given the scheduler's
        ``running`` requests, whether any request ``waiting`` and whether a running prompt is unfinished
        (``has_prefill_work``). Changes nothing: the caller carries the switch out (:class:`ReserveSwitch`)."""
        if self.config.mode != "elastic" or not self._region:
            return NO_SWITCH
        if self.lent:
            return self.reclaim_switch(running) if waiting else NO_SWITCH
        if running and not has_prefill_work:
            if self.pool.num_used >= self.config.lend_min_used_fraction * self.base_blocks:
                return self.lend_switch()
        return NO_SWITCH

    def lend_switch(self) -> ReserveSwitch:
        """Lend now (the next steps are decode-only): admission closes until the reclaim."""
        return NO_SWITCH if self.lent else ReserveSwitch("lend", (), admission_open=False)

    def reclaim_switch(self, running: Sequence[Request]) -> ReserveSwitch:
        """Reclaim now: the ``running`` requests holding a lent block are to be preempted (newest first),
        then admission reopens."""
        if not self.lent:
            return NO_SWITCH
        holders = [r for r in running if r.block_ids and max(r.block_ids) >= self.base_blocks]
        return ReserveSwitch("reclaim", tuple(reversed(holders)), admission_open=True)

    def apply(self, switch: ReserveSwitch, now: float) -> float:
        """Carry out ``switch`` once its requests are preempted: attach the region (lend), or evict the
        region's cached blocks and detach it (reclaim; raises if a block of it is still held). Returns the
        modelled map or unmap latency."""
        if switch.action == "lend":
            return self._lend(now)
        if switch.action == "reclaim":
            return self._reclaim(now, len(switch.preempt))
        return 0.0

    def _lend(self, now: float) -> float:
        if self.lent:
            return 0.0
        self.pool.attach(self._region)
        self.lent = True
        self._lent_since = now
        self.num_lends += 1
        self.peak_capacity_tokens = max(self.peak_capacity_tokens, self.pool.capacity_tokens)
        dt = self.config.map_s()
        self.switch_s += dt
        return dt

    def _reclaim(self, now: float, preempted: int) -> float:
        if not self.lent:
            return 0.0
        pool = self.pool
        if self.cache is not None:
            cached = [b for b in self._region if pool.ref_count(b) > 0]
            if cached:
                self.drain_evicted_blocks += evict_cached_blocks(self.cache, cached)
        pool.detach(self._region)  # raises if anything still holds a lent block: never reused in place
        self.drain_preemptions += preempted
        self.lent = False
        self.lent_s += now - self._lent_since
        self.num_reclaims += 1
        dt = self.config.unmap_s()
        self.switch_s += dt
        return dt

    # -- memory check -------------------------------------------------------------------------
    def activation_free_bytes(self) -> int:
        """Activation memory left: the reserve minus what KV pages beyond the base pool have taken."""
        overflow = max(0, self.pool.num_used - self.base_blocks)
        if self.config.mode == "elastic" and self.lent:
            overflow = self.config.reserve_blocks  # the whole region is mapped into the pool
        return self.config.reserve_bytes - overflow * self.config.block_bytes

    def step_activation_bytes(self, num_tokens: int, has_prefill: bool) -> int:
        fn = self.config.activation_bytes
        if fn is not None:
            return fn(num_tokens)
        return self.config.reserve_bytes if has_prefill else 0

    def fits(self, plan) -> bool:
        """Whether the plan's activations fit the memory left (False: the step would hit CUDA OOM)."""
        if self.config.mode == "elastic":
            if self.lent and plan.num_prefill_tokens:
                raise RuntimeError("elastic reserve: a prefill was planned while the reserve is lent")
            return True
        need = self.step_activation_bytes(plan.num_tokens, plan.num_prefill_tokens > 0)
        return need <= self.activation_free_bytes()

    def stats(self, now: float | None = None) -> dict:
        lent_s = self.lent_s + (now - self._lent_since if self.lent and now is not None else 0.0)
        return {
            "mode": self.config.mode,
            "reserve_blocks": self.config.reserve_blocks,
            "reserve_bytes": self.config.reserve_bytes,
            "lends": self.num_lends,
            "reclaims": self.num_reclaims,
            "drain_preemptions": self.drain_preemptions,
            "drain_evicted_blocks": self.drain_evicted_blocks,
            "switch_s": self.switch_s,
            "lent_s": lent_s,
            "peak_capacity_tokens": self.peak_capacity_tokens,
        }
