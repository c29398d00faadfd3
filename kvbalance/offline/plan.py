"""The offline plan: what a planner hands to whoever runs the job (the simulator or the real engine).

A planner is built from the ``PLANNERS`` registry (``kvbalance.offline.planners``) and called as
``plan = PLANNERS.get(name)().plan(requests, ctx)``. The plan's ``order`` lists indices into ``requests``,
every request exactly once, in the order they should be fed to the engine (FCFS admission then follows
the plan); ``ranks(n)`` splits it into ``n`` balanced lists for data parallelism, each a union of whole
subtrees (prefix groups) kept in execution order. ``warmup`` are the requests run first to sample output
lengths (BlendServe section 4.2): their results are real outputs and stay part of the job.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from kvbalance.registry import Registry

if TYPE_CHECKING:
    from kvbalance.request import Request

StepMode = Literal["sequential", "overlap"]
STEP_MODES: tuple[str, ...] = ("sequential", "overlap")


@dataclass(frozen=True)
class PlanContext:
    """What a planner may know about where the job runs. Units are in the field names.

    ``run_samples`` runs the warm-up requests (indices) and returns their true output lengths in the same
    order; without it the planner reads each request's ``max_tokens`` as its output length (simulation,
    where outputs run to their budget). ``kv_capacity_tokens`` is the free KV memory M of one replica
    (None: derived from the cost model for ``model`` on ``gpu`` x ``tp``).
    """

    model: str = "llama-3.1-8b"
    gpu: str = "a100-80gb"
    tp: int = 1
    block_size: int = 16
    kv_capacity_tokens: int | None = None
    chunk_tokens: int = 2048  # chunked-prefill token budget of one step (a multiple of 128, as in the paper)
    sample_fraction: float = 0.01  # share of requests run as the output-length warm-up
    seed: int = 0
    run_samples: Callable[[list[int]], Sequence[int]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp: must be a positive integer, got {self.tp!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens: must be >= 1, got {self.kv_capacity_tokens}")
        if self.chunk_tokens < 128 or self.chunk_tokens % 128:
            raise ValueError(f"chunk_tokens: must be a positive multiple of 128, got {self.chunk_tokens}")
        if not 0 <= self.sample_fraction <= 1:
            raise ValueError(f"sample_fraction: must be in [0, 1], got {self.sample_fraction}")


@dataclass
class OfflinePlan:
    """A planned job. ``groups`` are contiguous runs of ``order`` that stay on one rank (prefix subtrees);
    ``weights[i]`` is request i's estimated work (prompt + estimated output tokens) used to balance ranks.
    ``mode`` is the step-time model the planner's engine runs with; ``admission`` (optional), for planners
    that decide dynamically (``sglang-lpm``), has ``before_step(instance, now)``: a runner calls it before
    every ``instance.step(now)`` to reorder the waiting queue (the simulator does; FCFS in ``order`` otherwise).
    ``rank_fn`` replaces the default split of ``ranks`` (BlendServe re-plans each rank's subtrees)."""

    planner: str
    order: list[int]
    mode: StepMode = "sequential"
    groups: list[list[int]] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    warmup: list[int] = field(default_factory=list)
    batches: list[list[int]] = field(default_factory=list)  # planned batches (dual scan), for reports
    stats: dict = field(default_factory=dict)  # densities, sharing, estimation error, ...
    admission: object | None = None
    rank_fn: Callable[[int], list[list[int]]] | None = (
        None  # a planner's own split (e.g. re-planned per rank)
    )

    def __post_init__(self) -> None:
        n = len(self.order)
        if sorted(self.order) != list(range(n)):
            seen: set[int] = set()
            dup = next((i for i in self.order if i in seen or seen.add(i)), None)
            raise ValueError(
                f"order: must list every request index 0..{n - 1} exactly once "
                f"(first repeated or out of range: {dup})"
            )
        if self.mode not in STEP_MODES:
            raise ValueError(f"mode: must be one of {', '.join(STEP_MODES)}, got {self.mode!r}")
        if not self.groups:
            self.groups = [[i] for i in self.order]
        elif [i for g in self.groups for i in g] != self.order:
            raise ValueError("groups: must cut `order` into contiguous runs, in order")
        if not self.weights:
            self.weights = [1.0] * n
        elif len(self.weights) != n:
            raise ValueError(f"weights: need one per request ({n}), got {len(self.weights)}")

    def ranks(self, n: int) -> list[list[int]]:
        """Split the plan into ``n`` balanced lists for data parallelism (BlendServe section 4.5).

        Groups larger than an even share are cut into contiguous pieces; pieces go, heaviest first, to the
        lightest rank (LPT); each rank keeps its requests in plan order. Every request lands exactly once.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n: must be a positive integer, got {n!r}")
        if n == 1:
            return [list(self.order)]
        if self.rank_fn is not None:
            return self.rank_fn(n)
        w = self.weights
        share = sum(w) / n
        pieces: list[list[int]] = []
        for g in self.groups:
            cur: list[int] = []
            acc = 0.0
            for i in g:
                if cur and acc + w[i] > share:
                    pieces.append(cur)
                    cur, acc = [], 0.0
                cur.append(i)
                acc += w[i]
            if cur:
                pieces.append(cur)
        pos = {i: k for k, i in enumerate(self.order)}
        heap = [(0.0, r) for r in range(n)]
        out: list[list[int]] = [[] for _ in range(n)]
        for piece in sorted(pieces, key=lambda p: (-sum(w[i] for i in p), pos[p[0]])):
            load, r = heapq.heappop(heap)
            out[r].extend(piece)
            heapq.heappush(heap, (load + sum(w[i] for i in piece), r))
        return [sorted(rank, key=pos.__getitem__) for rank in out]


class Planner(Protocol):
    """One planner per file under ``kvbalance/offline/planners/``, registered by name in ``PLANNERS``."""

    name: str

    def plan(self, requests: Sequence[Request], ctx: PlanContext) -> OfflinePlan: ...


# name -> planner class; ``PLANNERS.get(name)()`` builds one with its defaults
PLANNERS: Registry[type[Planner]] = Registry("planner", "kvbalance.offline.planners")
