"""The router interface: pick one of the candidate instances for a new request from their load snapshots.

Routers are one class per file behind ``ROUTERS`` (``kvbalance.registry.Registry``); CLI choices and errors
come from ``ROUTERS.names()``. A router sees only ``InstanceLoad`` snapshots (one per candidate, in a fixed
order) and the request; routers that keep an approximate picture of where prefixes live (``cache_aware``,
``kv_aware``) build it from their own routing decisions, as sgl-router and Dynamo's approximate mode do.
Ties break to the lowest index, so routing is deterministic. Routers that keep state per instance key it by
the load's ``name`` (``load_keys``), not its position, so a candidate list that changes (a role flip) keeps
each instance's state with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbalance.engine import InstanceLoad
from kvbalance.registry import Registry
from kvbalance.request import Request

ROUTERS: Registry = Registry("router", "kvbalance.cluster.routers")


class Router:
    """Base class: ``choose`` returns an index into ``loads``; ``block_size`` is the cluster's KV block size.

    ``count_weights`` (a, b): ``choose`` reads only the counts and picks the lowest ``score``,
    a x (waiting + loading) + b x running, the lowest index on ties, whatever the request (None: it reads
    more; the default). The simulator then lets an instance run past arrivals it can prove go to others
    (``Cluster``, ``cluster/route_ahead.py``)."""

    count_weights: tuple[int, int] | None = None

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        raise NotImplementedError

    def arrivals_elsewhere(self, index: int, num_candidates: int) -> int | None:
        """How many of the next requests go to other candidates before one comes to candidate ``index``, where
        that does not depend on loads or requests (None: it may; the default). The simulator then lets an
        instance run ahead to its own next arrival (``Cluster``)."""
        return None

    def score(self, load: InstanceLoad) -> int:
        """The score ``choose`` gives ``load`` (routers with ``count_weights``)."""
        if self.count_weights is None:
            raise NotImplementedError(f"{type(self).__name__} does not pick by counts")
        a, b = self.count_weights
        return a * (load.num_waiting + load.num_loading) + b * load.num_running

    def forget(self, req: Request, index: int) -> None:
        """The request finished on candidate ``index`` (routers that count in-flight work may use it)."""


def argmin(scores: Sequence[float]) -> int:
    """Index of the smallest score, lowest index on ties."""
    best = 0
    for i in range(1, len(scores)):
        if scores[i] < scores[best]:
            best = i
    return best


def load_keys(loads: Sequence[InstanceLoad]) -> list[object]:
    """A stable key per candidate: its instance name, or its index when names repeat (crafted snapshots)."""
    names = [ld.name for ld in loads]
    return names if len(set(names)) == len(names) else list(range(len(loads)))


def build_router(name: str, block_size: int = 16, **options) -> Router:
    """A router by registry name; ``options`` go to its constructor (e.g. ``cache_threshold``)."""
    return ROUTERS.get(name)(block_size=block_size, **options)
