"""Scheduling policies, one module each (importing this package registers them all)."""

from kvbalance.scheduler.policies import sarathi, vllm  # noqa: F401
