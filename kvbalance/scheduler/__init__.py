"""Continuous batching: the scheduler core (token arithmetic) and its policies behind a registry."""

from kvbalance.scheduler.base import POLICIES, SchedulingPolicy
from kvbalance.scheduler.core import Scheduler, SchedulerConfig

__all__ = ["POLICIES", "Scheduler", "SchedulerConfig", "SchedulingPolicy"]
