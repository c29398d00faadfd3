"""Executors: run a scheduler's batch plan, simulated (cost model) or for real (PyTorch)."""

from kvbalance.batch import BatchPlan, ScheduledSeq, StepBreakdown, StepResult
from kvbalance.executor.base import Executor

__all__ = ["BatchPlan", "Executor", "ScheduledSeq", "StepBreakdown", "StepResult"]
