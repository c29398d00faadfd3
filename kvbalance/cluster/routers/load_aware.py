"""``load_aware``: BanaServe's router, least outstanding work in tokens; cache location is ignored.

With a global KV store any prefill instance can fetch a cached prefix, so where a prefix was last computed
no longer matters and the router balances work alone: outstanding = prefill tokens still to compute + output
tokens still to generate (``InstanceLoad.outstanding_tokens``), plus the new request's own tokens (which
do not change the choice; kept for clarity of the score).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbalance.cluster.routers.base import ROUTERS, Router, argmin
from kvbalance.engine import InstanceLoad
from kvbalance.request import Request


@ROUTERS.register("load_aware")
class LoadAwareRouter(Router):
    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        return argmin([ld.outstanding_tokens for ld in loads])
