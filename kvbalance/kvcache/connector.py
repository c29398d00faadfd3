"""KV connector, scheduler half: KV that comes from, or goes to, somewhere outside this instance.

vLLM v1's ``KVConnectorBase_V1`` split. The scheduler half (this module) answers, per request, how many
tokens beyond the local prefix hit can be loaded from outside (a prefill peer, a global KV store) and
whether the load is asynchronous; after allocation it records the loads and saves the step must do in
the plan (:class:`~kvbalance.batch.KVTransfer`); when a request finishes, it says whether the request's
blocks must stay until a save lands. The worker half is the executor: it moves the bytes (a modelled
transfer in simulation, tensor copies for real) and reports ``StepResult.finished_loads`` and
``finished_saves``, which the scheduler hands back through :meth:`KVConnector.update_connector_output`.

A request whose load is asynchronous waits in ``RequestState.WAITING_FOR_KV`` holding its blocks and is
not scheduled until its load is reported finished; a synchronous load happens inside the step that
computes the request's remaining tokens. :class:`NullConnector` (the default) never loads or saves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvbalance.batch import BatchPlan
    from kvbalance.request import Request


@runtime_checkable
class KVConnector(Protocol):
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` (the local prefix hit) that can be loaded from outside,
        and whether that load is asynchronous. Must leave at least one token to compute (the last one
        is computed to sample)."""
        ...

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request``: remember what to load into them (if anything)."""
        ...

    def build_connector_meta(self, plan: BatchPlan) -> None:
        """Record this step's loads and saves in ``plan.kv_loads`` / ``plan.kv_saves``."""
        ...

    def update_connector_output(self, finished_loads: list[str], finished_saves: list[str]) -> None:
        """The worker half reported these transfers done (request ids)."""
        ...

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """``request`` finished (or was aborted); True if its blocks must stay until its save lands."""
        ...


class NullConnector:
    """No KV from or to outside: every call is a no-op (the single-instance default)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, plan: BatchPlan) -> None:
        return None

    def update_connector_output(self, finished_loads: list[str], finished_saves: list[str]) -> None:
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        return False
