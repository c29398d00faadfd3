"""Output-length estimation by sampling (BlendServe section 4.2).

About 1% of the requests, spread over the prefix tree's subtrees, run first as a warm-up; their real outputs
are kept. Requests under the same prefix (one application's system prompt, one subject's few-shot prefix)
tend to have similar output lengths, so a subtree's estimate is the mean output length of its samples, and
an unsampled subtree takes its nearest sampled relative's (the closest ancestor with samples under it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbalance.offline.tree import Node, PrefixTree


@dataclass
class Estimate:
    """Estimated output length per request, the sampled requests, and the error against the truth."""

    output_lens: np.ndarray  # per request (sampled ones: their true length)
    samples: list[int]
    mean_abs_rel_error: float | None = None  # over unsampled requests, mean of |est - true| / true
    weighted_abs_error: float | None = None  # over unsampled requests, sum |est - true| / sum true
    total_rel_error: float | None = None  # (sum est - sum true) / sum true over unsampled requests

    def error_report(self, true_lens: Sequence[int]) -> Estimate:
        true = np.asarray(true_lens, dtype=np.float64)
        mask = np.ones(len(true), dtype=bool)
        mask[self.samples] = False
        if mask.any():
            est = self.output_lens[mask]
            self.mean_abs_rel_error = float(np.mean(np.abs(est - true[mask]) / true[mask]))
            self.weighted_abs_error = float(np.abs(est - true[mask]).sum() / true[mask].sum())
            self.total_rel_error = float((est.sum() - true[mask].sum()) / true[mask].sum())
        return self


MIN_GROUP = 8  # a unit (subtree, or a node's leaf children) this large is always sampled at the root


def _units(node: Node) -> list[list[Node]]:
    """A node's sampling units: each internal child, and its leaf children together (requests that share
    exactly this node's prefix are relatives of each other)."""
    leaves = [c for c in node.children if c.request is not None]
    units = [[c] for c in node.children if c.request is None]
    if leaves:
        units.append(leaves)
    return units


def choose_samples(tree: PrefixTree, fraction: float, seed: int = 0) -> list[int]:
    """About ``fraction`` of the requests, spread over subtrees (deterministic for a seed).

    A node's quota goes to its units in proportion to their sizes, at least one each while the quota lasts
    (a random size-weighted subset when it does not). At the root the quota is raised to cover every unit
    of ``MIN_GROUP`` or more requests, so no sizeable application or subject goes unsampled in a small job.
    """
    n = len(tree.leaves)
    if n == 0 or fraction <= 0:
        return []
    rng = np.random.default_rng(seed)
    picked: list[int] = []
    root_units = _units(tree.root)
    big = sum(1 for u in root_units if sum(c.n for c in u) >= MIN_GROUP)
    stack: list[tuple[list[Node], int]] = [([tree.root], max(1, round(fraction * n), big))]
    while stack:
        unit, quota = stack.pop()
        if quota <= 0:
            continue
        if len(unit) > 1 or unit[0].request is not None:  # leaf children: draw requests directly
            idx = rng.choice(len(unit), size=min(quota, len(unit)), replace=False)
            picked.extend(unit[int(i)].request for i in idx)
            continue
        units = _units(unit[0])
        sizes = np.array([sum(c.n for c in u) for u in units], dtype=np.float64)
        if quota >= len(units):
            shares = np.maximum(1, np.floor(quota * sizes / sizes.sum())).astype(int)
        else:
            shares = np.zeros(len(units), dtype=int)
            order = np.argsort(-sizes, kind="stable") if unit[0] is tree.root else None
            chosen = (
                order[:quota]
                if order is not None
                else rng.choice(len(units), size=quota, replace=False, p=sizes / sizes.sum())
            )
            shares[chosen] = 1
        stack.extend((u, int(q)) for u, q in zip(units, shares))
    return sorted(set(picked))


def estimate_output_lens(tree: PrefixTree, samples: list[int], sampled_lens: Sequence[int]) -> Estimate:
    """Each request's estimate: its own length if sampled; else the mean of its sampled leaf siblings (same
    prefix), else of the samples under its parent, else of the nearest ancestor with samples."""
    if len(samples) != len(sampled_lens):
        raise ValueError(f"sampled_lens: need one per sample ({len(samples)}), got {len(sampled_lens)}")
    if not samples:
        raise ValueError("samples: need at least one sampled request to estimate output lengths")
    known = dict(zip(samples, (float(x) for x in sampled_lens)))
    sums: dict[int, tuple[float, int]] = {}
    for node in tree.nodes_postorder():
        if node.request is not None:
            v = known.get(node.request)
            sums[id(node)] = (v, 1) if v is not None else (0.0, 0)
        else:
            s = c = 0.0
            for ch in node.children:
                a, b = sums[id(ch)]
                s += a
                c += b
            sums[id(node)] = (s, c)
    out = np.zeros(len(tree.leaves), dtype=np.float64)
    root_sum, root_cnt = sums[id(tree.root)]
    stack: list[tuple[Node, float]] = [(tree.root, root_sum / root_cnt)]
    while stack:
        node, inherited = stack.pop()
        s, c = sums[id(node)]
        mean = s / c if c else inherited
        leaf_vals = [known[ch.request] for ch in node.children if ch.request in known]
        leaf_mean = sum(leaf_vals) / len(leaf_vals) if leaf_vals else mean
        for ch in node.children:
            if ch.request is not None:
                out[ch.request] = known.get(ch.request, leaf_mean)
            else:
                stack.append((ch, mean))
    return Estimate(np.maximum(out, 1.0), list(samples))
