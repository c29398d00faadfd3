"""``least_loaded``: vLLM's data-parallel load balancer, score = waiting x 4 + running, lowest wins.

vLLM's DP coordinator weighs a queued request four times a running one (a waiting request will still need
its whole prefill; a running one is already paying its way). ``least_requests`` is the plain shortest queue
(waiting + running, sgl-router's load-balancing fallback and the queueing experiment's replica router).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbalance.cluster.routers.base import ROUTERS, Router, argmin
from kvbalance.engine import InstanceLoad
from kvbalance.request import Request

WAITING_WEIGHT = 4  # vLLM v1 DP load balancing: waiting * 4 + running


@ROUTERS.register("least_loaded")
class LeastLoadedRouter(Router):
    count_weights = (WAITING_WEIGHT, 1)

    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        return argmin([WAITING_WEIGHT * (ld.num_waiting + ld.num_loading) + ld.num_running for ld in loads])


@ROUTERS.register("least_requests")
class LeastRequestsRouter(Router):
    count_weights = (1, 1)

    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        return argmin([ld.num_waiting + ld.num_loading + ld.num_running for ld in loads])
