"""``density-balance``: a density-balanced order that ignores prefixes, on an overlapping engine (an ablation:
BlendServe's dual scan without its prefix tree; the paper's NanoFlow-Balance is a random order,
``nanoflow-balance``).

Requests are sorted by their own density Comp / Mem (no sharing credited) and dual-scanned from both ends with
the same memory split as BlendServe, so every batch blends compute- and memory-heavy work, but requests of one
prefix are scattered and the cache rarely keeps their prefix. Output lengths come from the same warm-up
sampling as BlendServe (a baseline at its best).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbalance.offline.admission import DualScanAdmission
from kvbalance.offline.density import comp_s, mem_s
from kvbalance.offline.dual_scan import dual_scan
from kvbalance.offline.plan import PLANNERS, OfflinePlan, PlanContext
from kvbalance.offline.planners._common import constants, job_stats, kv_tokens, prompt_lens, sampled_estimate
from kvbalance.offline.tree import PrefixTree
from kvbalance.request import Request


@PLANNERS.register("density-balance")
class DensityBalancePlanner:
    name = "density-balance"
    mode = "overlap"

    def plan(self, requests: Sequence[Request], ctx: PlanContext) -> OfflinePlan:
        k = constants(ctx)
        tree = PrefixTree.from_requests(requests, ctx.block_size)
        tree.annotate(np.ones(len(requests)), k)
        est = sampled_estimate(tree, requests, ctx)
        p, d = prompt_lens(requests), est.output_lens
        comp, mem = comp_s(p, d, k), mem_s(p, d, k)
        rho = comp / mem
        warm = set(est.samples)
        seq = [int(i) for i in np.argsort(-rho, kind="stable") if int(i) not in warm]
        rho_root = float(comp.sum() / mem.sum())
        ds = dual_scan(seq, p, d, comp, mem, rho_root, kv_tokens(ctx), ctx.chunk_tokens)
        stats = job_stats(requests, tree, k)
        stats.update(
            estimate_mean_abs_rel_error=est.mean_abs_rel_error,
            m_left_tokens=ds.m_left_tokens,
            m_right_tokens=ds.m_right_tokens,
        )
        order = list(est.samples) + ds.order
        plan = OfflinePlan(
            self.name, order, mode=self.mode, weights=(p + d).astype(float).tolist(), warmup=list(est.samples)
        )
        plan.batches = ds.batches
        plan.admission = DualScanAdmission(
            est.samples, seq, p, d, comp, mem, rho_root, kv_tokens(ctx), chunk_tokens=ctx.chunk_tokens
        )
        plan.stats = stats
        return plan
