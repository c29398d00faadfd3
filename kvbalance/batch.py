"""What crosses the scheduler <-> executor boundary: the plan of one step and its result.

The scheduler emits a :class:`BatchPlan`; an executor (simulated cost model or real PyTorch
model) runs it and returns a :class:`StepResult`. Nothing in a plan depends on which executor
runs it. This module sits on the ground floor: it imports only ``request`` (for type hints).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbalance.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    """One request's work in a step: compute KV for positions ``[start, start + num_new_tokens)``.

    The KV of those tokens goes to ``request.block_ids`` (position p -> block
    ``block_ids[p // block_size]``, offset ``p % block_size``). ``sample`` is true when the
    step produces this request's next token (the chunk reaches the end of its known tokens).
    """

    request: Request
    start: int
    num_new_tokens: int
    sample: bool

    @property
    def context_len(self) -> int:
        """Tokens whose KV exists after this step (attention span of the last new token)."""
        return self.start + self.num_new_tokens

    @property
    def is_prefill(self) -> bool:
        return self.start < self.request.num_prompt_tokens


@dataclass(slots=True)
class KVTransfer:
    """Blocks to move between this instance and somewhere outside (peer, host, remote store).

    A global-store transfer names each block by its prefix hash too (``block_hashes``, one per block id):
    the store keys blocks by hash, the instance by block id."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    direction: str  # "load" or "save"
    peer: str = ""
    block_hashes: list[int] = field(default_factory=list)  # a store transfer: each block's chained hash


@dataclass
class BatchPlan:
    """What one step computes. ``seqs`` lists decodes first, then prefill chunks.

    ``cohort_seqs`` decodes more, not listed in ``seqs``: the scheduler's decode cohort (a simulator fast
    path, ``scheduler/cohort.py``), each computing one token and sampling, their contexts after the step
    summing to ``cohort_context``; only an executor that takes them (``SimExecutor``) ever sees a plan with
    them (0 otherwise)."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    block_size: int = 16
    kv_loads: list[KVTransfer] = field(default_factory=list)
    kv_saves: list[KVTransfer] = field(default_factory=list)
    cohort_seqs: int = 0
    cohort_context: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs) + self.cohort_seqs

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs if s.is_prefill)

    @property
    def num_decode_seqs(self) -> int:
        return sum(1 for s in self.seqs if not s.is_prefill) + self.cohort_seqs

    @property
    def num_sampled(self) -> int:
        return sum(1 for s in self.seqs if s.sample) + self.cohort_seqs

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.cohort_seqs and not self.kv_loads and not self.kv_saves


@dataclass
class StepBreakdown:
    """Where a step's time goes (seconds). Simulated: predicted; real: ``total_s`` measured."""

    compute_s: float = 0.0  # operators whose compute-bound time won the roofline max
    memory_s: float = 0.0  # operators whose memory-bound time won
    overhead_s: float = 0.0  # launches, scheduling, sampling
    comm_s: float = 0.0  # tensor-parallel all-reduce
    transfer_s: float = 0.0  # KV transfer not hidden behind compute
    flops: float = 0.0
    bytes: float = 0.0


@dataclass
class StepResult:
    """What an executor reports back for one plan."""

    duration_s: float
    sampled: dict[str, int] = field(default_factory=dict)  # request_id -> token id
    logprobs: dict[str, object] = field(default_factory=dict)  # request_id -> logprob info
    finished_loads: list[str] = field(default_factory=list)
    finished_saves: list[str] = field(default_factory=list)
    breakdown: StepBreakdown = field(default_factory=StepBreakdown)
