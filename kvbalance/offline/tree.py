"""Resource-aware prefix tree (BlendServe section 4.1): the job's prompts in a radix tree over the radix
cache's chained block hashes, each node carrying its subtree's request count, shared-prefix length and
compute density.

Every request is one leaf; an internal node is a branching point whose edge holds the blocks its subtree
shares. Block i of a prompt is named by the chained hash of tokens [0, (i + 1) * block_size) exactly as
``kvcache.prefix.prefix_block_hashes`` names it, so two prompts share a node iff the prefix cache would
share those blocks. Building is one pass down the tree: a group of requests finds its longest common run of
hashes by binary search (chained hashes are equal on a prefix, then differ) and splits on the next hash.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvbalance.kvcache.prefix import prefix_block_hashes
from kvbalance.offline.density import DensityConstants, comp_s, mem_s


class Node:
    """A tree node: blocks [start, end) of its subtree's shared prefix on its edge; ``request`` on leaves."""

    __slots__ = (
        "start",
        "end",
        "children",
        "parent",
        "request",
        "depth",
        "n",
        "prompt_tokens",
        "computed_tokens",
        "comp_s",
        "mem_s",
        "density",
        "rho_min",
        "rho_max",
    )

    def __init__(self, start: int, end: int, parent: Node | None, request: int | None = None) -> None:
        self.start = start
        self.end = end
        self.parent = parent
        self.request = request
        self.depth = 0 if parent is None else parent.depth + 1
        self.children: list[Node] = []
        self.n = 0
        self.prompt_tokens = 0
        self.computed_tokens = 0.0
        self.comp_s = 0.0
        self.mem_s = 0.0
        self.density = 0.0
        self.rho_min = 0.0
        self.rho_max = 0.0

    @property
    def is_leaf(self) -> bool:
        return self.request is not None

    @property
    def sharing(self) -> float:
        """Share of the subtree's prompt tokens that its shared prefixes save (computed once, not n times)."""
        return 1.0 - self.computed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def __repr__(self) -> str:
        kind = f"leaf {self.request}" if self.is_leaf else f"{len(self.children)} children"
        return f"Node(blocks {self.start}-{self.end}, {kind}, n={self.n}, rho={self.density:.3g})"


def block_hashes(requests: Sequence, block_size: int) -> list[np.ndarray]:
    """Each prompt's chained full-block hashes (the radix cache's names), as uint64 arrays."""
    return [
        np.asarray(prefix_block_hashes(r.prompt_token_ids, block_size), dtype=np.uint64) for r in requests
    ]


def _common_blocks(a: np.ndarray, b: np.ndarray, lo: int, hi: int) -> int:
    """Largest k in [lo, hi] with a[:k] == b[:k], given a[:lo] == b[:lo] (chained: equal up to k, then not)."""
    if hi <= lo or a[hi - 1] == b[hi - 1]:
        return hi
    while lo < hi - 1:  # invariant: a[:lo] equal, a[hi - 1] differs
        mid = (lo + hi) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixTree:
    """The prefix tree of a job. ``prompt_lens[i]`` tokens, ``hashes[i]`` its full-block hashes."""

    def __init__(self, hashes: list[np.ndarray], prompt_lens: Sequence[int], block_size: int) -> None:
        if len(hashes) != len(prompt_lens):
            raise ValueError(f"hashes: need one list per request ({len(prompt_lens)}), got {len(hashes)}")
        self.block_size = block_size
        self.prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
        self.root = Node(0, 0, None)
        self.leaves: list[Node] = [None] * len(hashes)  # type: ignore[list-item]
        self._build(hashes)

    @classmethod
    def from_requests(cls, requests: Sequence, block_size: int) -> PrefixTree:
        return cls(block_hashes(requests, block_size), [r.num_prompt_tokens for r in requests], block_size)

    def _build(self, hashes: list[np.ndarray]) -> None:
        stack: list[tuple[Node, list[int]]] = [(self.root, list(range(len(hashes))))]
        while stack:
            node, members = stack.pop()
            if node is not self.root:
                if len(members) == 1:
                    node.end = len(hashes[members[0]])
                    node.request = members[0]
                    self.leaves[members[0]] = node
                    continue
                first = hashes[members[0]]
                lcp = len(first)
                for m in members[1:]:
                    h = hashes[m]
                    lcp = _common_blocks(first, h, node.start + 1, min(lcp, len(h)))
                node.end = lcp
            depth = node.end
            groups: dict[int, list[int]] = {}
            for m in members:
                h = hashes[m]
                if len(h) == depth:
                    leaf = Node(depth, depth, node, m)
                    node.children.append(leaf)
                    self.leaves[m] = leaf
                else:
                    groups.setdefault(int(h[depth]), []).append(m)
            for group in groups.values():
                child = Node(depth, depth, node)
                node.children.append(child)
                stack.append((child, group))

    # -- traversal -----------------------------------------------------------------------------------
    def nodes_postorder(self) -> Iterator[Node]:
        stack: list[tuple[Node, bool]] = [(self.root, False)]
        while stack:
            node, done = stack.pop()
            if done or not node.children:
                yield node
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(node.children))

    def leaf_order(self) -> list[int]:
        """Request indices in DFS order (children in their list order)."""
        out: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.request is not None:
                out.append(node.request)
            else:
                stack.extend(reversed(node.children))
        return out

    # -- annotation ----------------------------------------------------------------------------------
    def annotate(self, output_lens: Sequence[float], k: DensityConstants) -> None:
        """Fill every node's counts, Comp/Mem totals and density for (estimated) output lengths.

        A leaf's computed tokens are the prompt tokens past its parent's shared prefix; an internal node adds
        its edge's blocks once. Leaf density is the request's own rho with its ancestors' edges amortised over
        their subtrees (``leaf_density``); a node's is (1 - s) T_comp / T_mem of its subtree.
        """
        bs = self.block_size
        d = np.asarray(output_lens, dtype=np.float64)
        p = self.prompt_lens
        comps, mems = comp_s(p, d, k), mem_s(p, d, k)
        for node in self.nodes_postorder():
            if node.request is not None:
                i = node.request
                node.n = 1
                node.prompt_tokens = int(p[i])
                node.computed_tokens = float(p[i] - node.start * bs)
                node.comp_s, node.mem_s = float(comps[i]), float(mems[i])
            else:
                ch = node.children
                node.n = sum(c.n for c in ch)
                node.prompt_tokens = sum(c.prompt_tokens for c in ch)
                node.computed_tokens = sum(c.computed_tokens for c in ch) + (node.end - node.start) * bs
                node.comp_s = sum(c.comp_s for c in ch)
                node.mem_s = sum(c.mem_s for c in ch)
            node.density = (1.0 - node.sharing) * node.comp_s / node.mem_s if node.mem_s > 0 else float("inf")
        self._leaf_density = self._amortised_leaf_density(comps, mems)
        for node in self.nodes_postorder():
            if node.request is not None:
                node.rho_min = node.rho_max = float(self._leaf_density[node.request])
            else:
                node.rho_min = min(c.rho_min for c in node.children)
                node.rho_max = max(c.rho_max for c in node.children)

    def _amortised_leaf_density(self, comps: np.ndarray, mems: np.ndarray) -> np.ndarray:
        bs = self.block_size
        share = np.zeros(len(self.leaves))  # amortised computed tokens per request
        stack: list[tuple[Node, float]] = [(self.root, 0.0)]
        while stack:
            node, above = stack.pop()
            if node.request is not None:
                share[node.request] = above + self.prompt_lens[node.request] - node.start * bs
                continue
            here = above + (node.end - node.start) * bs / node.n if node.n else above
            stack.extend((c, here) for c in node.children)
        self._amortised_tokens = share
        frac = share / np.maximum(self.prompt_lens, 1)
        return frac * comps / mems

    @property
    def amortised_tokens(self) -> np.ndarray:
        """Per request: prompt tokens it computes, its ancestors' shared edges split over their subtrees."""
        return self._amortised_tokens

    @property
    def leaf_density(self) -> np.ndarray:
        """Per request: (computed share of its prompt) x Comp / Mem, after ``annotate``."""
        return self._leaf_density

    @property
    def dfs_sharing(self) -> float:
        """s_opt: the share of all prompt tokens a DFS order serves from the cache (each prefix computed once)."""
        return self.root.sharing

    def sort_children(self) -> None:
        """Per-level ordering (section 4.3): children by density, compute-heavy first (stable on ties)."""
        for node in self.nodes_postorder():
            if node.children:
                node.children.sort(key=lambda c: -c.density)
