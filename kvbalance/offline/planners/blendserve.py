"""``blendserve``: BlendServe's planner (ASPLOS'26), on an overlapping (NanoFlow-style) engine.

1. the resource-aware prefix tree over the prompts' block hashes (``tree.py``);
2. output lengths estimated from a ~1% warm-up sample spread over subtrees (``estimate.py``); the warm-up runs
   first and its outputs are kept;
3. per-level sort by density and conditional node splitting, keeping >= 99% of the sharing (``split.py``);
4. dual scanning of the density-ordered leaves from both ends under the KV memory split M_L / M_R and the
   per-step prefill budgets C_L / C_R (``dual_scan.py`` plays it on a fluid clock into ``order``;
   ``admission.py`` plays it against the live engine in the simulator);
5. data parallelism: the tree cut into balanced subtrees, one per rank, each rank dual-scanned on its own.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from kvbalance.offline.admission import DualScanAdmission
from kvbalance.offline.density import mem_s
from kvbalance.offline.dual_scan import dual_scan
from kvbalance.offline.plan import PLANNERS, OfflinePlan, PlanContext
from kvbalance.offline.planners._common import (
    constants,
    job_stats,
    kv_tokens,
    prompt_lens,
    sampled_estimate,
    subtree_leaves,
)
from kvbalance.offline.split import sort_and_split
from kvbalance.offline.tree import Node, PrefixTree
from kvbalance.request import Request


@PLANNERS.register("blendserve")
class BlendServePlanner:
    name = "blendserve"
    mode = "overlap"

    def __init__(
        self,
        keep_sharing: float = 0.99,
        enforce_budgets: bool = True,
        live_admission: bool = True,
        budget_rule: str = "aligned",
        memory_rule: str = "auto",
        pace_engine: bool = True,
    ) -> None:
        """``enforce_budgets=False`` drops C_L / C_R (memory shares only); ``live_admission=False`` leaves
        the engine the static ``order`` alone (both ablations); ``budget_rule="paper"`` sets C_L as
        N_L p / d (``dual_scan.py``); ``memory_rule`` is the live admission's memory-heavy share check
        (``admission.py``); ``pace_engine=False`` leaves the engine's chunk budget alone (the budgets then pace
        releases only, ``admission.py``)."""
        self.keep_sharing = keep_sharing
        self.enforce_budgets = enforce_budgets
        self.live_admission = live_admission
        self.budget_rule = budget_rule
        self.memory_rule = memory_rule
        self.pace_engine = pace_engine

    def plan(self, requests: Sequence[Request], ctx: PlanContext) -> OfflinePlan:
        k = constants(ctx)
        tree = PrefixTree.from_requests(requests, ctx.block_size)
        tree.annotate(np.ones(len(requests)), k)  # counts for the sampler
        est = sampled_estimate(tree, requests, ctx)
        d = est.output_lens
        split = sort_and_split(tree, d, k, self.keep_sharing)
        p = prompt_lens(requests)
        mem = mem_s(p, d, k)
        eff_comp = tree.leaf_density * mem
        m_tokens = kv_tokens(ctx)
        rho_root = tree.root.density  # estimated; job_stats below re-annotates with the true lengths
        amortised = tree.amortised_tokens.copy()
        warm = set(est.samples)

        def scan(leaves: list[int]):
            rest = [i for i in leaves if i not in warm]
            return dual_scan(
                rest,
                p,
                d,
                eff_comp,
                mem,
                rho_root,
                m_tokens,
                ctx.chunk_tokens,
                amortised,
                enforce_budgets=self.enforce_budgets,
                budget_rule=self.budget_rule,
            )

        leaves = tree.leaf_order()
        ds = scan(leaves)
        order = list(est.samples) + ds.order
        weights = (p + d).astype(float).tolist()
        stats = job_stats(requests, tree, k)
        stats.update(
            root_density_estimated=rho_root,
            planned_sharing=tree.dfs_sharing,
            sharing_kept=split.sharing_kept,
            num_splits=split.num_splits,
            split_leaf_fraction=split.split_leaves / max(len(requests), 1),
            leaves_monotone=split.monotone,
            sort_split_rounds=split.rounds,
            num_samples=len(est.samples),
            estimate_mean_abs_rel_error=est.mean_abs_rel_error,
            estimate_weighted_abs_error=est.weighted_abs_error,
            estimate_total_rel_error=est.total_rel_error,
            m_left_tokens=ds.m_left_tokens,
            m_right_tokens=ds.m_right_tokens,
            left_prefill_budget_tokens=ds.c_left_tokens,
            right_prefill_budget_tokens=ds.c_right_tokens,
            scan_steps=ds.steps,
            num_batches=len(ds.batches),
        )
        plan = OfflinePlan(self.name, order, mode=self.mode, weights=weights, warmup=list(est.samples))
        rest = [i for i in leaves if i not in warm]
        if self.live_admission:
            plan.admission = DualScanAdmission(
                est.samples,
                rest,
                amortised,
                d,
                eff_comp,
                mem,
                rho_root,
                m_tokens,
                chunk_tokens=ctx.chunk_tokens,
                enforce_budgets=self.enforce_budgets,
                budget_rule=self.budget_rule,
                memory_rule=self.memory_rule,
                pace_engine=self.pace_engine,
            )
        plan.batches = ds.batches
        plan.stats = stats
        plan.rank_fn = lambda n: self._ranks(n, tree, weights, est.samples, scan)
        return plan

    @staticmethod
    def _ranks(n: int, tree: PrefixTree, w: list[float], samples: list[int], scan) -> list[list[int]]:
        """Balanced subtrees, one set per rank (heavy subtrees opened into their children), LPT-assigned;
        each rank runs its warm-up samples, then its own dual scan."""
        total = sum(w)
        share = total / n

        def weight(node: Node) -> float:
            return sum(w[i] for i in subtree_leaves(node))

        pieces: list[tuple[float, Node]] = []
        stack = list(tree.root.children)
        while stack:
            node = stack.pop()
            wt = weight(node)
            if wt > share and node.children:
                stack.extend(node.children)
            else:
                pieces.append((wt, node))
        heap = [(0.0, r) for r in range(n)]
        members: list[set[int]] = [set() for _ in range(n)]
        for wt, node in sorted(pieces, key=lambda x: (-x[0], x[1].depth, min(subtree_leaves(x[1])))):
            load, r = heapq.heappop(heap)
            members[r].update(subtree_leaves(node))
            heapq.heappush(heap, (load + wt, r))
        leaf_order = tree.leaf_order()
        out = []
        for m in members:
            mine = [i for i in leaf_order if i in m]
            out.append([i for i in samples if i in m] + scan(mine).order)
        return out
