"""The engine-thread half of ``AsyncEngine``: the step loop and everything it does between steps.

Only this thread calls into the backend (``server.backend``: an ``LLMEngine`` or a cluster; add, abort, step), so the scheduler and KV cache see one thread.
It applies queued commands (add, abort, fail all), steps, accounts each output in the metrics, publishes
the engine's ``InstanceLoad`` and only then sends outputs back, so a client that has its answer also sees
it in ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque

from kvbalance.request import RequestState, SamplingParams
from kvbalance.server.backend import RequestFailed
from kvbalance.server.metrics import ServerMetrics
from kvbalance.server.streams import EngineStopped, Rejected, RequestStream, StreamOutput

log = logging.getLogger(__name__)


class EngineThread:
    """Mixin for ``AsyncEngine``: ``_run`` is the thread's body. Needs the attributes set below."""

    engine: object
    metrics: ServerMetrics
    error: BaseException | None
    max_context: int
    _cond: threading.Condition
    _commands: deque
    _streams: dict[str, RequestStream]
    _stop: bool

    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not self._stop and not self._commands and not eng.has_unfinished():
                    self._cond.wait()
                if self._stop:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for cmd in commands:
                self._apply(cmd)
            if eng.has_unfinished():
                steps_before = eng.num_steps
                try:
                    outputs = eng.step()
                except Exception as exc:  # a broken step must not hang every caller
                    log.exception("engine step failed")
                    self.error = exc
                    self._fail_all(RuntimeError(f"engine step failed: {exc}"), "error")
                    outputs = []
                sends = self._dispatch(outputs)
                self._publish_state()  # before the outputs go out: a client that got its answer sees it
                for stream, item in sends:
                    self._send(stream, item)
                if eng.num_steps == steps_before and eng.has_unfinished():
                    with self._cond:  # nothing schedulable right now: do not spin
                        self._cond.wait(0.005)
            else:
                self._publish_state()

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            self._abort_now(cmd[1])
        elif cmd[0] == "fail":
            self._fail_all(cmd[1], cmd[2])
        else:
            self._add_now(*cmd[1:])

    def _abort_now(self, rid: str) -> None:
        with self._cond:
            stream = self._streams.pop(rid, None)
        if stream is None:
            return
        self.engine.abort(rid)
        self._forget(rid)
        self.metrics.request_done("abort")
        self._send(stream, self._final(stream, "abort"))

    def _add_now(self, stream: RequestStream, ids: list[int], params: SamplingParams, fill: bool) -> None:
        eng, rid = self.engine, stream.request_id
        with self._cond:
            if rid not in self._streams:  # aborted before it got here
                self._send_accept(stream, EngineStopped("aborted before it was queued"))
                return
        try:
            if fill:
                params = dataclasses.replace(params, max_tokens=max(1, self._room(len(ids))))
            req = eng.add_request(ids, params, rid)
            if req.state is RequestState.REJECTED:
                raise Rejected(req.reject_reason or "rejected")
        except Exception as exc:
            with self._cond:
                self._streams.pop(rid, None)
            self.metrics.request_done("rejected")
            self._send_accept(stream, exc)
            return
        stream.prompt_token_ids = list(ids)
        self.metrics.add_tokens(prompt_tokens=len(ids))
        self._send_accept(stream, None)

    def _room(self, num_prompt_tokens: int) -> int:
        """Largest output budget the context and the whole KV cache leave a prompt (may be < 1)."""
        capacity = self.engine.kv_capacity_tokens
        return min(self.max_context - num_prompt_tokens, capacity - num_prompt_tokens + 1)

    def _dispatch(self, outputs) -> list[tuple[RequestStream, StreamOutput | BaseException]]:
        """Account for a step's outputs; returns what to send to whom."""
        sends = []
        for out in outputs:
            if isinstance(out, RequestFailed):
                with self._cond:
                    stream = self._streams.pop(out.request_id, None)
                if stream is not None:
                    self._forget(out.request_id)
                    self.metrics.request_done("error")
                    sends.append((stream, out.error))
                continue
            with self._cond:
                stream = self._streams.get(out.request_id)
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
            if stream is None:
                continue  # aborted while the step ran
            req = out.request
            logprobs: list = []
            if req.sampling.logprobs is not None:
                logprobs = list(req.output_logprobs[stream.logprobs_sent :])
                stream.logprobs_sent = len(req.output_logprobs)
            self.metrics.add_tokens(generation_tokens=len(out.new_token_ids))
            if out.finished:
                self._forget(out.request_id)
                self.metrics.request_done(out.finish_reason or "stop", req.ttft_s, req.tpot_s, req.e2e_s)
            item = StreamOutput(
                out.request_id,
                list(out.new_token_ids),
                out.text_delta,
                out.finished,
                out.finish_reason,
                req.num_prompt_tokens,
                req.num_output_tokens,
                logprobs,
                req,
            )
            sends.append((stream, item))
        return sends

    def _fail_all(self, exc: BaseException, reason: str) -> None:
        """End every request in flight with ``exc`` (engine thread); their KV blocks are freed."""
        with self._cond:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            try:
                self.engine.abort(stream.request_id)
            except Exception:
                log.exception("abort of %s failed", stream.request_id)
            self._forget(stream.request_id)
            self.metrics.request_done(reason)
            self._send_accept(stream, exc)
            self._send(stream, exc)

    def _forget(self, request_id: str) -> None:
        # LLMEngine keeps the detokeniser state of finished requests for text_of(); a server must drop it.
        detok = getattr(self.engine, "_detok", None)
        if isinstance(detok, dict):
            detok.pop(request_id, None)

    @staticmethod
    def _final(stream: RequestStream, reason: str) -> StreamOutput:
        n = len(stream.prompt_token_ids)
        return StreamOutput(stream.request_id, [], "", True, reason, n, 0)

    @staticmethod
    def _send(stream: RequestStream, item: StreamOutput | BaseException) -> None:
        try:
            stream._loop.call_soon_threadsafe(stream.push, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    @staticmethod
    def _send_accept(stream: RequestStream, error: BaseException | None) -> None:
        try:
            stream._loop.call_soon_threadsafe(stream.resolve, error)
        except RuntimeError:
            pass

    def _publish_state(self) -> None:
        self.metrics.set_engine_state(self.engine.load(), self.engine.block_size)
