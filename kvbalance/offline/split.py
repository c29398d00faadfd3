"""Per-level sorting and conditional node splitting (BlendServe section 4.3).

After sorting every node's children by density (compute-heavy first), the DFS leaves are in density order
only where subtrees' density ranges do not overlap. Where two neighbouring leaves break the order, the
subtree on one side of their lowest common ancestor is cut: its children are re-placed under the root, so
the root's sort can interleave them with the rest. Cutting node X loses the sharing of its prefix among its
children, about prefix_len(X) x (children(X) - 1) tokens (exactly that plus X's start, since X's own edge is
no longer computed once); X is cut only when that loss is within its budget, the
root's children having budget t and a node's children budget(X) / children(X) (the paper's recursion with
t / children). t is 1% of the DFS-shared tokens, and splits stop once their total loss would pass t, so at
least 99% of the sharing is kept. Sort and split repeat until leaf densities are non-increasing from left to
right, or nothing more may be cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbalance.offline.density import DensityConstants
from kvbalance.offline.tree import Node, PrefixTree


@dataclass
class SplitStats:
    threshold_tokens: float
    lost_tokens: float = 0.0
    num_splits: int = 0
    split_leaves: int = 0  # requests whose subtree was re-placed under the root
    rounds: int = 0
    monotone: bool = False
    sharing_before: float = 0.0
    sharing_after: float = 0.0

    @property
    def sharing_kept(self) -> float:
        return self.sharing_after / self.sharing_before if self.sharing_before > 0 else 1.0


def split_cost_tokens(node: Node, block_size: int) -> float:
    """Sharing lost by cutting ``node``: every child recomputes the whole prefix, instead of the subtree
    computing the node's own edge once: end * children - (end - start) blocks."""
    ch = len(node.children)
    return (node.end * ch - (node.end - node.start)) * block_size if ch else 0.0


def _budgets(tree: PrefixTree, t: float) -> dict[int, float]:
    out: dict[int, float] = {}
    stack = [(c, t) for c in tree.root.children]
    while stack:
        node, b = stack.pop()
        out[id(node)] = b
        if node.children:
            stack.extend((c, b / len(node.children)) for c in node.children)
    return out


def _side_child(leaf: Node, lca_depth: int) -> Node:
    node = leaf
    while node.depth > lca_depth + 1:
        node = node.parent
    return node


def _lca_depth(a: Node, b: Node) -> int:
    while a.depth > b.depth:
        a = a.parent
    while b.depth > a.depth:
        b = b.parent
    while a is not b:
        a, b = a.parent, b.parent
    return a.depth


def _cut(tree: PrefixTree, node: Node) -> None:
    """Re-place ``node``'s children under the root (each keeps the full prefix on its own edge)."""
    parent = node.parent
    parent.children.remove(node)
    root = tree.root
    stack = []
    for c in node.children:
        c.parent = root
        c.start = 0
        stack.append(c)
        root.children.append(c)
    while stack:
        n = stack.pop()
        n.depth = n.parent.depth + 1
        stack.extend(n.children)
    node.children = []
    if parent is not root and len(parent.children) == 1:  # a chain: fold the lone child into its parent
        only = parent.children[0]
        only.start = parent.start
        grand = parent.parent
        grand.children[grand.children.index(parent)] = only
        only.parent = grand
        stack = [only]
        while stack:
            n = stack.pop()
            n.depth = n.parent.depth + 1
            stack.extend(n.children)


def sort_and_split(
    tree: PrefixTree,
    output_lens: Sequence[float],
    k: DensityConstants,
    keep_sharing: float = 0.99,
    max_rounds: int = 16,
) -> SplitStats:
    """Sort children by density and cut nodes until DFS leaf densities are non-increasing (or no cut fits)."""
    if not 0 <= keep_sharing <= 1:
        raise ValueError(f"keep_sharing: must be in [0, 1], got {keep_sharing}")
    bs = tree.block_size
    tree.annotate(output_lens, k)
    shared = tree.root.prompt_tokens - tree.root.computed_tokens
    stats = SplitStats(threshold_tokens=(1.0 - keep_sharing) * shared, sharing_before=tree.dfs_sharing)
    for rnd in range(max_rounds):
        stats.rounds = rnd + 1
        tree.sort_children()
        order = tree.leaf_order()
        rho = tree.leaf_density[order]
        bad = np.nonzero(rho[:-1] < rho[1:] * (1 - 1e-9))[0]
        if len(bad) == 0:
            stats.monotone = True
            break
        budgets = _budgets(tree, stats.threshold_tokens)
        chosen: dict[int, Node] = {}
        for i in bad.tolist():
            a, b = tree.leaves[order[i]], tree.leaves[order[i + 1]]
            depth = _lca_depth(a, b)
            for side in (_side_child(a, depth), _side_child(b, depth)):
                if side.children and id(side) not in chosen:
                    cost = split_cost_tokens(side, bs)
                    if cost <= budgets[id(side)] and stats.lost_tokens + cost <= stats.threshold_tokens:
                        chosen[id(side)] = side
                        stats.lost_tokens += cost
                        break
        if not chosen:
            break
        for node in chosen.values():
            if node.parent is None or node not in node.parent.children:
                continue
            stats.split_leaves += node.n
            stats.num_splits += 1
            _cut(tree, node)
        tree.annotate(output_lens, k)
    tree.sort_children()
    stats.sharing_after = tree.dfs_sharing
    return stats
