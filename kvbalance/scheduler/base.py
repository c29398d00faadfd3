"""What a scheduling policy is, and the registry that finds one by name.

A policy decides, each step, which running requests advance and which waiting ones are admitted, using
the scheduler's two primitives (:meth:`~kvbalance.scheduler.core.Scheduler.schedule_running` and
:meth:`~kvbalance.scheduler.core.Scheduler.admit_waiting`). A new policy is one new module under
``kvbalance/scheduler/policies/`` decorated with ``@POLICIES.register("name")`` and listed in that
package's ``__init__``; the CLI's choices and the config checks come from ``POLICIES.names()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

from kvbalance.registry import Registry

if TYPE_CHECKING:
    from kvbalance.batch import BatchPlan
    from kvbalance.scheduler.core import Scheduler


class SchedulingPolicy(Protocol):
    name: ClassVar[str]
    whole_prompts: ClassVar[bool]  # admits only whole prompts (no chunked prefill)

    @staticmethod
    def token_budget(chunk_size: int, max_context: int) -> int:
        """The per-step token budget this policy runs with, given the configured chunk size."""
        ...

    def schedule(self, scheduler: Scheduler, plan: BatchPlan, now: float) -> None:
        """Fill ``plan`` with this step's work."""
        ...


POLICIES: Registry[type[SchedulingPolicy]] = Registry("policy", "kvbalance.scheduler.policies")
