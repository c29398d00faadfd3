"""Offline planners, one class per module, each registered in :data:`kvbalance.offline.plan.PLANNERS`."""

from kvbalance.offline.planners import fcfs  # noqa: F401
