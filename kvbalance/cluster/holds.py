"""Blocks the cluster holds on an instance outside any running request (KV waiting to leave or to be used).

A ``BlockHold`` is what a request leaves behind when KV must outlive its stay on an instance (the prefill
side keeps the blocks until the save lands) or arrive before it is admitted (the decode side keeps landed
blocks until admission): a lock on the request's cached prefix path plus a pool reference on every block,
exactly like a running request's, so the prefix cache's own invariant (ref count = 1 + lock_ref) holds.
``check_member`` is the scheduler's block-accounting check with these holds counted as holders.
Stopgap until the KV cache manager / connector on main own this (TODO(connector)).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvbalance.engine import Instance
from kvbalance.kvcache.prefix import RadixNode, request_block_hashes
from kvbalance.request import Request, RequestState


@dataclass
class BlockHold:
    node: RadixNode | None = None  # locked cached path (None: nothing cached)
    blocks: list[int] = field(default_factory=list)  # one pool reference each


def _make_room(inst: Instance, n: int) -> bool:
    short = n - inst.pool.num_free
    if short > 0 and inst.cache is not None:
        inst.cache.evict(short)
    return inst.pool.num_free >= n


def hold_computed(inst: Instance, req: Request, num_tokens: int) -> BlockHold:
    """Hold ``req``'s first ``num_tokens`` of KV on ``inst`` after the scheduler released it.

    Full blocks are still in the prefix cache (evictable): lock their path and reference them. The partial
    tail block was freed; hold a fresh block for it (its contents are what a real connector would keep).
    """
    bs = inst.pool.block_size
    hold = BlockHold()
    cached = 0
    if inst.cache is not None and num_tokens >= bs:
        node, cached = inst.cache.match_prefix(request_block_hashes(req, bs, (num_tokens // bs) * bs))
        if cached:
            inst.cache.lock(node)
            hold.node = node
            hold.blocks = inst.cache.blocks_of(node)
            inst.pool.incref(hold.blocks)
    rest = inst.pool.blocks_for_tokens(num_tokens) - cached
    if rest > 0 and _make_room(inst, rest):
        hold.blocks += inst.pool.allocate(rest)
    return hold


def land(inst: Instance, req: Request, num_tokens: int, blocks: list[int]) -> BlockHold:
    """KV for ``req``'s first ``num_tokens`` landed in ``blocks`` (reserved on ``inst``): cache the full
    blocks under a hold so admission finds them as a prefix hit; the partial tail block is released (it is
    recomputed, < block_size tokens). Blocks some other request cached first are shared, ours freed."""
    bs = inst.pool.block_size
    full = num_tokens // bs
    hold = BlockHold()
    if inst.cache is None or full == 0:
        inst.pool.free(blocks)
        return hold
    node, cached = inst.cache.extend(inst.cache.root, 0, request_block_hashes(req, bs, full * bs), blocks)
    for own, b in zip(blocks[:full], cached):
        if own != b:  # already cached: share it
            inst.pool.incref((b,))
            inst.pool.free((own,))
    inst.pool.free(blocks[full:])
    hold.node, hold.blocks = node, list(cached)
    return hold


def release(inst: Instance, hold: BlockHold) -> None:
    if hold.node is not None:
        inst.cache.unlock(hold.node)
        hold.node = None
    if hold.blocks:
        inst.pool.free(hold.blocks)
        hold.blocks = []


def check_member(inst: Instance, holds: Iterable[BlockHold], extra_blocks: Iterable[int] = ()) -> None:
    """Every block's ref count = running requests holding it + holds + 1 if cached (no leak, no double free)."""
    sched = inst.scheduler
    inst.pool.check_invariants()
    if inst.cache is not None:
        inst.cache.check_invariants()
    refs: dict[int, int] = {}
    for req in sched.running:
        if req.state is not RequestState.RUNNING:
            raise AssertionError(f"{req} in the running list")
        for b in req.block_ids:
            refs[b] = refs.get(b, 0) + 1
    for req in sched.waiting:
        if req.block_ids:
            raise AssertionError(f"{req}: waiting but holds blocks")
    for h in holds:
        for b in h.blocks:
            refs[b] = refs.get(b, 0) + 1
    for b in extra_blocks:
        refs[b] = refs.get(b, 0) + 1
    cached = inst.cache.all_block_ids() if inst.cache is not None else set()
    for b in range(inst.pool.num_total_blocks):
        expect = refs.get(b, 0) + (1 if b in cached else 0)
        if inst.pool.ref_count(b) != expect:
            raise AssertionError(
                f"{inst.name}: block {b} ref count {inst.pool.ref_count(b)} != holders {expect}"
            )
