"""``Instance.load()`` on demand, for the cluster's routers: counts at once, token sums on first use (and
``PastLoad``: the counts an instance had at an arrival it has since been simulated past).

``Instance.load()`` walks every running and waiting request (O(requests)) for its token sums; a router of
counts (``least_loaded``, ``round_robin``, the decode router) reads none of them, and on an 8-GPU cluster
the walk was about half of the simulator's time. ``LazyLoad`` answers the O(1) fields from the instance's
scheduler and builds the full ``InstanceLoad`` only when another field is read. Routers read a load inside
``choose``, before anything changes the instance, so the values are those of a snapshot taken then.
"""

from __future__ import annotations

from typing import Any

from kvbalance.engine import Instance, InstanceLoad


class LazyLoad:
    """Duck-typed ``InstanceLoad`` of ``instance``: read it before the instance changes (as routers do)."""

    __slots__ = ("_instance", "_full")

    def __init__(self, instance: Instance) -> None:
        self._instance = instance
        self._full: InstanceLoad | None = None

    @property
    def name(self) -> str:
        return self._instance.name

    @property
    def num_waiting(self) -> int:
        return self._instance.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self._instance.scheduler.num_running

    @property
    def num_loading(self) -> int:
        return self._instance.scheduler.num_loading

    @property
    def kv_used_tokens(self) -> int:
        return self._instance.scheduler.kv_used_tokens

    @property
    def kv_capacity_tokens(self) -> int:
        return self._instance.kv_capacity_tokens

    @property
    def busy_s(self) -> float:
        return self._instance.busy_s

    def full(self) -> InstanceLoad:
        if self._full is None:
            self._full = self._instance.load()
        return self._full

    def __getattr__(self, field: str) -> Any:  # the O(requests) fields: token sums, utilisation
        return getattr(self.full(), field)


class PastLoad:
    """An instance's counts for a router that reads nothing else (``Router.count_weights``): those it had at an
    arrival it has since been simulated past (it provably goes to another: ``cluster/route_ahead.py``), or
    its counts now (set before each arrival there)."""

    __slots__ = ("name", "num_waiting", "num_loading", "num_running")

    def __init__(self, name: str, waiting: int, loading: int, running: int) -> None:
        self.name = name
        self.num_waiting = waiting
        self.num_loading = loading
        self.num_running = running
