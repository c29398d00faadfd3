"""The cluster's KV connector (scheduler half) on each instance, routing its calls to the P/D hand-off
(``disagg.py``) and the global KV store (``store_connector.py``).

One ``ClusterConnector`` per instance implements ``kvcache.connector.KVConnector``: a decode instance is
offered a prefilled request's prompt KV as external tokens (loaded asynchronously: the request waits in
WAITING_FOR_KV holding its blocks); a prefill or colocated instance with a store is offered the stored
prefix past its local hit; a prefill instance's ``request_finished`` keeps a handed-off request's blocks
until the save lands. Transfers are timed by the cluster on its links (not by the executor), so completions
arrive between steps and are reported with ``report_transfers``.
"""

from __future__ import annotations

from kvbalance.batch import BatchPlan
from kvbalance.engine import Instance
from kvbalance.kvcache.hashing import BlockHasher
from kvbalance.request import Request


def prompt_hashes(
    req: Request, block_size: int, num_tokens: int, hasher: BlockHasher | None = None
) -> list[int]:
    """Chained hashes (``hasher``'s: the instance's; SHA-256 by default) of the prompt's full blocks among
    its first ``num_tokens`` tokens."""
    return (hasher or BlockHasher()).prefix_block_hashes(
        req.prompt_token_ids, block_size, 0, 0, min(num_tokens, req.num_prompt_tokens) // block_size
    )


def report_transfers(inst: Instance, finished_loads: list[str], finished_saves: list[str]) -> None:
    """The worker half finished these transfers between steps (the cluster's link model)."""
    inst.transfers_done(finished_loads, finished_saves)


class ClusterConnector:
    """One member's connector. Its role is the member's current one (a role flip changes where new work is
    routed; work already on the member goes on as it began): a P/D hand-off addressed to the member is loaded
    whatever its role now, a prefill begun on it is held for its hand-off after a flip too."""

    def __init__(self, cluster, role: str) -> None:
        self.cluster = cluster
        self._role = role
        self.member = None  # set when the member is built

    @property
    def role(self) -> str:
        return self.member.role if self.member is not None else self._role

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        c = self.cluster
        if c.pd is not None and c.pd.is_handoff_to(self.member, request):
            return c.pd.matched(self.member, request, num_computed_tokens)
        if c.store is not None and self.role != "decode":
            return c.store.matched(self.member, request, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pd = self.cluster.pd
        if pd is not None and pd.is_handoff_to(self.member, request):
            pd.admitted(self.member, request, num_external_tokens)
        elif num_external_tokens > 0:
            self.cluster.store.start_fetch(self.member, request, num_external_tokens)

    @property
    def passive(self) -> bool:
        """Whether this connector does nothing per step (no P/D hand-off, no store): a scheduler may then run
        steps without telling it (the decode cohort's runs)."""
        c = self.cluster
        return c is not None and c.pd is None and c.store is None

    def build_connector_meta(self, plan: BatchPlan) -> None:
        # transfers are timed on the cluster's links, not inside the step; a real member's saves to the
        # store need the block tables as planned
        store = self.cluster.store
        if store is not None and self.role != "decode":
            store.record_block_tables(self.member, plan)

    def update_connector_output(self, finished_loads: list[str], finished_saves: list[str]) -> None:
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        pd = self.cluster.pd
        return pd is not None and pd.holds_for(self.member, request, block_ids)
