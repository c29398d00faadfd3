"""``llumnix``: Llumnix's (OSDI '24) load-based dispatch — send a new request to the freest instance.

Freeness (Llumnix §4.4; its code's ``remaining_steps`` load) = (KV capacity - virtual usage) / batch size, in
blocks per request: virtual usage is the KV held by requests plus the demand of the queued ones (their
whole length: a head-of-line request that does not fit makes its instance look busy), the batch size the
requests there (running, queued, loading). From an ``InstanceLoad``: (capacity - used - queued prefill
tokens) / block size / requests; an instance with no request is infinitely free. Highest wins, lowest
index on ties. The same number drives Llumnix's migration pairing (``cluster/llumnix.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvbalance.cluster.routers.base import ROUTERS, Router, argmin
from kvbalance.engine import InstanceLoad
from kvbalance.request import Request


def freeness_blocks(load: InstanceLoad, block_size: int) -> float:
    """Llumnix's freeness of one instance: free KV blocks per request after the queued requests' demand."""
    n = load.num_running + load.num_waiting + load.num_loading
    if n == 0:
        return math.inf
    free_tokens = load.kv_capacity_tokens - load.kv_used_tokens - load.queued_prefill_tokens
    return free_tokens / block_size / n


@ROUTERS.register("llumnix")
class LlumnixRouter(Router):
    def choose(self, req: Request, loads: Sequence[InstanceLoad]) -> int:
        return argmin([-freeness_blocks(ld, self.block_size) for ld in loads])
