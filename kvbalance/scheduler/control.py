"""What other components do to a scheduler's requests from outside its step loop.

The elastic KV reserve preempts (``preempt``); stop strings and client aborts end requests
(``finish_request``, ``abort``); request-level live migration (``cluster/request_migration.py``, Llumnix)
takes a running request off one instance (``detach``) and brings it into another (``reserve_blocks``, then
``admit_reserved``). A mixin of :class:`~kvbalance.scheduler.core.Scheduler`: it works on the scheduler's
own state (``running``, ``waiting``, ``loading``, the held-block maps and the KV cache manager ``kv``).
"""

from __future__ import annotations

from kvbalance.request import Request, RequestState


class RequestControl:
    def preempt(self, req: Request) -> None:
        """Preempt a running request from outside (it frees its blocks and resumes later by recompute)."""
        if req.state is not RequestState.RUNNING:
            raise ValueError(f"req: {req.request_id} is {req.state.value}, not running")
        self.settle()
        self._preempt(req)

    # -- live migration (a request's KV moving to another instance while it runs) -------
    def detach(self, req: Request) -> None:
        """Take a running request off this instance without finishing it (it continues elsewhere): it leaves
        the running list; its blocks and cache lock stay held until ``_apply_transfers([], [rid])`` (the
        copy that reads them landed)."""
        if req.state is not RequestState.RUNNING:
            raise ValueError(f"req: {req.request_id} is {req.state.value}, not running")
        self.settle()
        if self._cohort is not None:
            self._cohort_forget(req)
        self.running.remove(req)
        self.kv.forget(req)
        self._hold(req, for_load=False)

    def reserve_blocks(self, request_id: str, num_blocks: int) -> bool:
        """Hold ``num_blocks`` more blocks (the watermark stays available) for a request whose KV is being
        copied here before it arrives; False (nothing changed) if they don't fit. They go back with
        ``_apply_transfers([rid], [])`` or become the request's block table in :meth:`admit_reserved`."""
        blocks = self.kv.reserve(num_blocks, self._watermark_blocks)
        if blocks is None:
            return False
        self._held.setdefault(request_id, []).extend(blocks)
        self._held_paths.setdefault(request_id, None)
        self._held_for_load[request_id] = True
        return True

    def admit_reserved(self, req: Request, num_computed_tokens: int) -> None:
        """``req`` takes the blocks reserved for it as its block table and waits in WAITING_FOR_KV until its
        last blocks land (``_apply_transfers([rid], [])``), then runs with ``num_computed_tokens`` computed."""
        rid = req.request_id
        if not self._held_for_load.get(rid) or req.block_ids:
            raise ValueError(f"req: {rid} has no blocks reserved here, or holds blocks elsewhere")
        if len(self._held[rid]) < self.kv.blocks_for_tokens(num_computed_tokens):
            raise ValueError(f"num_computed_tokens: {num_computed_tokens} do not fit {rid}'s reserved blocks")
        req.block_ids = self._held.pop(rid)
        self._held_paths.pop(rid)
        self._held_for_load.pop(rid)
        req.num_computed_tokens = num_computed_tokens
        req.state = RequestState.WAITING_FOR_KV
        self.loading[rid] = req
        self._load_target[rid] = num_computed_tokens

    def finish_request(self, req: Request, reason: str, now: float, state=RequestState.FINISHED) -> None:
        """End a request from outside (stop string matched, client abort)."""
        if req.is_finished:
            return
        self.settle()
        if req.state is RequestState.RUNNING:
            if self._cohort is not None:
                self._cohort_forget(req)
            self._release(req, finished=True)
            self.running.remove(req)
        elif req.state is RequestState.WAITING_FOR_KV:
            # its load still writes into its blocks: keep them until the load is reported done
            del self.loading[req.request_id]
            self._load_target.pop(req.request_id, None)
            self.kv.forget(req)
            if not self._null_connector:
                self.connector.request_finished(req, req.block_ids)
            self._hold(req, for_load=True)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
            self.kv.forget(req)
        req.state = state
        req.finish_reason = reason
        req.finish_s = now

    def abort(self, req: Request, now: float) -> None:
        self.finish_request(req, "abort", now, state=RequestState.ABORTED)
