"""Executors: run a scheduler's batch plan, simulated (cost model) or for real (PyTorch)."""

from kvbalance.executor.base import BatchPlan, Executor, ScheduledSeq, StepBreakdown, StepResult

__all__ = ["BatchPlan", "Executor", "ScheduledSeq", "StepBreakdown", "StepResult"]
