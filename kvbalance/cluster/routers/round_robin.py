"""``round_robin``: candidates in turn, whatever their load (the baseline every router is measured against)."""

from __future__ import annotations

from collections.abc import Sequence

from kvbalance.cluster.routers.base import ROUTERS, Router
from kvbalance.engine import InstanceLoad
from kvbalance.request import Request


@ROUTERS.register("round_robin")
class RoundRobinRouter(Router):
    def __init__(self, block_size: int = 16) -> None:
        super().__init__(block_size)
        self._next = 0

    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        i = self._next % len(loads)
        self._next += 1
        return i

    def arrivals_elsewhere(self, index: int, num_candidates: int) -> int | None:
        return (index - self._next) % num_candidates
