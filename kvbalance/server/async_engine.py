"""AsyncEngine: one background thread drives ``LLMEngine.step()``; asyncio callers stream their tokens.

Every ``LLMEngine`` call (tokenising, adding, aborting, stepping) happens on the engine thread, so the
scheduler and KV cache never see two threads. Callers hand it commands through a queue guarded by a
condition variable; the thread drains the queue between steps (continuous batching: a request joins the
next step after it arrives), sleeps on the condition when there is no work, and sends each request's
outputs back to the event loop that submitted it with ``loop.call_soon_threadsafe``.

    aengine = AsyncEngine(LLMEngine("smollm2-135m"), max_queue=64)
    aengine.start()
    async for out in aengine.generate(prompt_ids, SamplingParams(max_tokens=32)):
        print(out.text_delta, end="")
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbalance.request import Request, RequestState, SamplingParams
from kvbalance.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | list[dict[str, Any]]  # text, token ids, or chat messages


class Overloaded(RuntimeError):
    """Waiting plus running requests reached ``max_queue`` (the HTTP layer answers 429)."""


class EngineStopped(RuntimeError):
    """The engine loop is not running (never started, shut down, or crashed)."""


class Rejected(ValueError):
    """The engine can never run this request (prompt longer than the context, KV cache too small)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class StreamOutput:
    """One request's progress since its previous output (a ``RequestOutput`` taken on the engine thread)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list = field(default_factory=list)  # TokenLogprobs of the new tokens, when asked for
    request: Request | None = None


class RequestStream:
    """A submitted request's outputs, in order, delivered on the event loop that submitted it."""

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = []
        self.finished = False  # the final output (or an error) was taken by the consumer
        self._engine = engine
        self._loop = loop
        self._items: deque[StreamOutput | BaseException] = deque()
        self._event = asyncio.Event()
        self._accepted: asyncio.Future = loop.create_future()
        self._logprobs_sent = 0  # engine thread only

    # -- engine thread side (always through call_soon_threadsafe) ---------------------
    def _push(self, item: StreamOutput | BaseException) -> None:
        self._items.append(item)
        self._event.set()

    def _resolve(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    # -- consumer side ------------------------------------------------------------------
    async def next(self, timeout: float | None = None) -> StreamOutput | None:
        """The next output; ``None`` if ``timeout`` passes first; StopAsyncIteration after the final one."""
        while not self._items:
            if self.finished:
                raise StopAsyncIteration
            self._event.clear()
            if timeout is None:
                await self._event.wait()
            else:
                try:
                    await asyncio.wait_for(self._event.wait(), timeout)
                except TimeoutError:
                    return None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        out = await self.next()
        assert out is not None
        return out

    def abort(self) -> None:
        """Stop generating and free the request's KV blocks (a no-op once it has finished)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Continuous batching of concurrent asyncio callers over one ``LLMEngine`` on one thread."""

    def __init__(self, engine, max_queue: int = 256) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue: must be an int >= 1, got {max_queue!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = ServerMetrics()
        self.error: BaseException | None = None  # the latest step failure
        self._cond = threading.Condition()
        self._commands: deque[tuple] = deque()
        self._streams: dict[str, RequestStream] = {}  # in flight (queued command, waiting or running)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._ids = itertools.count()
        self._publish_state()

    # -- facts the HTTP layer needs -------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_context(self) -> int:
        return self.engine.instance.max_context

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self.is_running:
            return
        with self._cond:
            self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvbalance-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after the current step; requests still in flight end with finish_reason 'abort'."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread = None
        with self._cond:
            streams = list(self._streams.values())
            self._streams.clear()
            self._commands.clear()
        for stream in streams:
            try:
                if stream.request_id in self.engine.requests:
                    self.engine.abort(stream.request_id)
            except Exception:  # the loop is gone; freeing is best effort
                log.exception("abort of %s during shutdown failed", stream.request_id)
            self._send_accept(stream, EngineStopped("the engine was shut down"))
            self._send(stream, self._final(stream, "abort"))

    # -- requests (event loop side) -------------------------------------------------
    async def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        fill_max_tokens: bool = False,
    ) -> RequestStream:
        """Queue a request and wait until the engine thread accepted it.

        ``prompt`` is text, token ids, or chat messages (a list of dicts, templated by the tokenizer).
        With ``fill_max_tokens`` the output budget becomes all the room the context and KV cache leave.
        Raises Overloaded (queue full), Rejected (can never run), ValueError naming the bad field,
        EngineStopped.
        """
        if not self.is_running:
            raise EngineStopped("the engine loop is not running")
        loop = asyncio.get_running_loop()
        rid = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, rid, loop)
        with self._cond:
            if len(self._streams) >= self.max_queue:
                raise Overloaded(
                    f"server overloaded: {len(self._streams)} requests waiting or running (max_queue "
                    f"{self.max_queue}); retry later"
                )
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already in use")
            self._streams[rid] = stream
            self._commands.append(("add", stream, prompt, params or SamplingParams(), fill_max_tokens))
            self._cond.notify()
        try:
            await stream._accepted
        except asyncio.CancelledError:
            self.abort(rid)
            raise
        return stream

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[StreamOutput]:
        """Submit and yield outputs until the request finishes; leaving early aborts it."""
        stream = await self.submit(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request in flight (frees its KV blocks on the engine thread); unknown ids are ignored."""
        with self._cond:
            if request_id in self._streams:
                self._commands.append(("abort", request_id))
                self._cond.notify()

    # -- engine thread ------------------------------------------------------------------
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
                steps_before = eng.instance.num_steps
                try:
                    outputs = eng.step()
                except Exception as exc:  # a broken step must not hang every caller
                    log.exception("engine step failed")
                    self._fail_all(exc)
                    outputs = []
                self._dispatch(outputs)
                if eng.instance.num_steps == steps_before and eng.has_unfinished():
                    with self._cond:  # nothing schedulable right now: do not spin
                        self._cond.wait(0.005)
            self._publish_state()

    def _apply(self, cmd: tuple) -> None:
        eng = self.engine
        if cmd[0] == "abort":
            rid = cmd[1]
            with self._cond:
                stream = self._streams.pop(rid, None)
            if stream is None:
                return
            eng.abort(rid)
            self._forget(rid)
            self.metrics.request_done("abort")
            self._send(stream, self._final(stream, "abort"))
            return
        _, stream, prompt, params, fill_max_tokens = cmd
        rid = stream.request_id
        try:
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                ids = eng.chat_prompt(prompt)
            else:
                ids = eng.encode(prompt)
            if fill_max_tokens:
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
        inst = self.engine.instance
        return min(inst.max_context - num_prompt_tokens, inst.pool.capacity_tokens - num_prompt_tokens + 1)

    def _dispatch(self, outputs) -> None:
        for out in outputs:
            with self._cond:
                stream = self._streams.get(out.request_id)
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
            if stream is None:
                continue  # aborted while the step ran
            req = out.request
            logprobs: list = []
            if req.sampling.logprobs is not None:
                logprobs = list(req.output_logprobs[stream._logprobs_sent :])
                stream._logprobs_sent = len(req.output_logprobs)
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
            self._send(stream, item)

    def _fail_all(self, exc: BaseException) -> None:
        self.error = exc
        with self._cond:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            try:
                self.engine.abort(stream.request_id)
            except Exception:
                log.exception("abort of %s after a failed step failed", stream.request_id)
            self._forget(stream.request_id)
            self.metrics.request_done("error")
            self._send_accept(stream, RuntimeError(f"engine step failed: {exc}"))
            self._send(stream, RuntimeError(f"engine step failed: {exc}"))

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
            stream._loop.call_soon_threadsafe(stream._push, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    @staticmethod
    def _send_accept(stream: RequestStream, error: BaseException | None) -> None:
        try:
            stream._loop.call_soon_threadsafe(stream._resolve, error)
        except RuntimeError:
            pass

    def _publish_state(self) -> None:
        inst = self.engine.instance
        sched, pool = inst.scheduler, inst.pool
        cap = pool.capacity_tokens
        used = sched.kv_used_tokens
        gauges = {
            "num_requests_running": sched.num_running,
            "num_requests_waiting": sched.num_waiting,
            "kv_used_tokens": used,
            "kv_capacity_tokens": cap,
            "kv_usage_ratio": used / cap if cap else 0.0,
            "kv_free_blocks": pool.num_free,
            "prefix_cache_hit_rate": sched.prefix_hit_tokens / sched.admitted_tokens
            if sched.admitted_tokens
            else 0.0,
        }
        counters = {
            "preemptions_total": sched.num_preemptions,
            "prefix_hit_tokens_total": sched.prefix_hit_tokens,
            "engine_steps_total": inst.num_steps,
        }
        self.metrics.set_engine_state(gauges, counters)
