"""The executor protocol: what runs a :class:`~kvbalance.batch.BatchPlan` (cost model or real model).

The plan and result types live in :mod:`kvbalance.batch`; executors never import the scheduler.
"""

from __future__ import annotations

from typing import Protocol

from kvbalance.batch import BatchPlan, StepResult


class Executor(Protocol):
    """Runs a batch plan. ``num_kv_blocks`` is fixed at construction by the caller."""

    def execute(self, plan: BatchPlan) -> StepResult: ...
