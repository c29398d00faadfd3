"""Shared steps of the planners: lengths, the prefix tree, sampled output estimates, KV memory, DFS groups."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbalance.offline.density import DensityConstants, comp_s, mem_s
from kvbalance.offline.estimate import Estimate, choose_samples, estimate_output_lens
from kvbalance.offline.plan import OfflinePlan, PlanContext
from kvbalance.offline.tree import Node, PrefixTree
from kvbalance.request import Request


def prompt_lens(requests: Sequence[Request]) -> np.ndarray:
    return np.fromiter((r.num_prompt_tokens for r in requests), dtype=np.int64, count=len(requests))


def budget_lens(requests: Sequence[Request]) -> np.ndarray:
    """Each request's output budget (``max_tokens``): its true length in simulation (outputs run to it)."""
    return np.fromiter((r.max_tokens for r in requests), dtype=np.int64, count=len(requests))


def weights(requests: Sequence[Request], output_lens: Sequence[float] | None = None) -> list[float]:
    d = budget_lens(requests) if output_lens is None else np.asarray(output_lens)
    return (prompt_lens(requests) + d).astype(float).tolist()


def constants(ctx: PlanContext) -> DensityConstants:
    return DensityConstants.for_model(ctx.model, ctx.gpu, ctx.tp)


MAX_NUM_SEQS = 1024  # the offline engine's sequence cap (simulate.OfflineEngineConfig's default)


def kv_tokens(ctx: PlanContext, max_num_seqs: int = MAX_NUM_SEQS) -> int:
    """Free KV memory M of one replica, in tokens (per GPU; TP shards the KV heads), after weights and the
    activation reserve of the chunk budget (``perf.memory``)."""
    if ctx.kv_capacity_tokens is not None:
        return ctx.kv_capacity_tokens
    from kvbalance.perf.memory import engine_activation_reserve_bytes, kv_capacity_tokens
    from kvbalance.specs import get_model

    reserve = engine_activation_reserve_bytes(get_model(ctx.model), ctx.tp, ctx.chunk_tokens, max_num_seqs)
    return kv_capacity_tokens(ctx.model, ctx.gpu, ctx.tp, 0.9, reserve)


def sampled_estimate(tree: PrefixTree, requests: Sequence[Request], ctx: PlanContext) -> Estimate:
    """Run (or, in simulation, read) the warm-up samples and estimate every request's output length."""
    samples = choose_samples(tree, ctx.sample_fraction, ctx.seed)
    if not samples:
        return Estimate(budget_lens(requests).astype(float), [])
    if ctx.run_samples is not None:
        lens = list(ctx.run_samples(samples))
        est = estimate_output_lens(tree, samples, lens)
    else:
        true = budget_lens(requests)
        est = estimate_output_lens(tree, samples, true[samples].tolist())
        est.error_report(true)
    return est


def subtree_leaves(node: Node) -> list[int]:
    out: list[int] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if n.request is not None:
            out.append(n.request)
        else:
            stack.extend(reversed(n.children))
    return out


def dfs_plan_parts(
    requests: Sequence[Request], ctx: PlanContext
) -> tuple[list[int], list[list[int]], PrefixTree]:
    """DFS order over the prefix tree (children in first-appearance order), grouped by the root's subtrees."""
    tree = PrefixTree.from_requests(requests, ctx.block_size)
    groups = [subtree_leaves(c) for c in tree.root.children]
    order = [i for g in groups for i in g]
    return order, groups, tree


def job_stats(requests: Sequence[Request], tree: PrefixTree, k: DensityConstants) -> dict:
    """Job-level figures from the true output budgets: T_comp, T_mem, s_opt and the ideal bound
    max((1 - s_opt) T_comp, T_mem) (re-annotates ``tree`` with the true lengths)."""
    p, d = prompt_lens(requests), budget_lens(requests)
    tree.annotate(d, k)
    t_comp = float(comp_s(p, d, k).sum())
    t_mem = float(mem_s(p, d, k).sum())
    s = tree.dfs_sharing
    return {
        "num_requests": len(requests),
        "t_comp_s": t_comp,
        "t_mem_s": t_mem,
        "dfs_sharing": s,
        "density": (1 - s) * t_comp / t_mem if t_mem else float("inf"),
        "ideal_bound_s": max((1 - s) * t_comp, t_mem),
    }


class DFSPlanner:
    """The job in prefix-tree DFS order (children in first-appearance order): maximum prefix sharing.
    Subclasses name the engine: sequential (vLLM, SGLang) or overlap (NanoFlow) step times."""

    name = "dfs"
    mode = "sequential"

    def plan(self, requests: Sequence[Request], ctx: PlanContext) -> OfflinePlan:
        order, groups, tree = dfs_plan_parts(requests, ctx)
        stats = {"dfs_sharing": tree.dfs_sharing}
        return OfflinePlan(
            self.name, order, mode=self.mode, groups=groups, weights=weights(requests), stats=stats
        )
