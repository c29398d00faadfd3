"""``load_aware``: BanaServe's router, least outstanding work in tokens; cache location is ignored.

With a global KV store any prefill instance can fetch a cached prefix, so where a prefix was last computed
no longer matters and the router balances work alone: outstanding = prefill tokens still to compute + output
tokens still to generate (``InstanceLoad.outstanding_tokens``). Ties (typically several idle instances)
go to the instance that has been busy least so far (``busy_s``), then the lowest index, so light load is
spread instead of piling onto the first instance.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbalance.cluster.routers.base import ROUTERS, Router
from kvbalance.engine import InstanceLoad
from kvbalance.request import Request


@ROUTERS.register("load_aware")
class LoadAwareRouter(Router):
    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        return min(range(len(loads)), key=lambda i: (loads[i].outstanding_tokens, loads[i].busy_s, i))
