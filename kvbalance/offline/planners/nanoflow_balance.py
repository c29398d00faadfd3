"""``nanoflow-balance``: the paper's NanoFlow-Balance, the job in a seeded random order on an overlapping engine.

A random order mixes compute- and memory-heavy requests in every batch on average (BlendServe section 6.1 uses
it as the balance-only baseline) and scatters the requests of one prefix, so the prefix cache keeps a shared
prefix only while its requests happen to come close together.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbalance.offline.plan import PLANNERS, OfflinePlan, PlanContext
from kvbalance.offline.planners._common import weights
from kvbalance.request import Request


@PLANNERS.register("nanoflow-balance")
class NanoFlowBalancePlanner:
    name = "nanoflow-balance"
    mode = "overlap"

    def plan(self, requests: Sequence[Request], ctx: PlanContext) -> OfflinePlan:
        order = np.random.default_rng(ctx.seed).permutation(len(requests)).tolist()
        return OfflinePlan(self.name, order, mode=self.mode, weights=weights(requests))
