"""AsyncEngine: one background thread drives ``LLMEngine.step()``; asyncio callers stream their tokens.

Every scheduler and KV-cache call (adding, aborting, stepping) happens on the engine thread, so they never
see two threads. Tokenising and chat templates run before that, on a tokenizer thread of their own, so a
huge prompt delays only its own request, never the running streams. Callers hand the engine thread
commands through a queue guarded by a condition variable; the thread drains the queue between steps
(continuous batching: a request joins the next step after it arrives), sleeps on the condition when there
is no work, and sends each request's outputs back to the event loop that submitted it with
``loop.call_soon_threadsafe``.

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
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbalance.request import RequestState, SamplingParams
from kvbalance.server.metrics import ServerMetrics
from kvbalance.server.streams import EngineStopped, Overloaded, Rejected, RequestStream, StreamOutput

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | list[dict[str, Any]]  # text, token ids, or chat messages
DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN = 32  # text longer than this x the context cannot fit it in practice


class AsyncEngine:
    """Continuous batching of concurrent asyncio callers over one ``LLMEngine`` on one thread.

    ``max_queue`` bounds requests waiting or running (more: Overloaded); ``max_prompt_chars`` bounds the
    text handed to the tokenizer (default: 32 characters per token of context).
    """

    def __init__(self, engine, max_queue: int = 256, max_prompt_chars: int | None = None) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue: must be an int >= 1, got {max_queue!r}")
        if max_prompt_chars is None:
            max_prompt_chars = DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN * engine.instance.max_context
        if (
            isinstance(max_prompt_chars, bool)
            or not isinstance(max_prompt_chars, int)
            or max_prompt_chars < 1
        ):
            raise ValueError(f"max_prompt_chars: must be an int >= 1, got {max_prompt_chars!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.max_prompt_chars = max_prompt_chars
        self.metrics = ServerMetrics()
        self.error: BaseException | None = None  # the latest step failure
        self._cond = threading.Condition()
        self._commands: deque[tuple] = deque()
        self._streams: dict[str, RequestStream] = {}  # in flight (queued command, waiting or running)
        self._thread: threading.Thread | None = None
        self._tokenizer_pool: ThreadPoolExecutor | None = None
        self._stop = False
        self._draining = False
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
            self._draining = False
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="kvbalance-tokenizer")
        self._thread = threading.Thread(target=self._run, name="kvbalance-engine", daemon=True)
        self._thread.start()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, wait up to ``timeout_s`` for those in flight, then end the rest with an error.

        Returns how many were still running at the deadline (their streams get an error, then [DONE]).
        """
        with self._cond:
            self._draining = True
        deadline = time.monotonic() + max(0.0, timeout_s)
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with self._cond:
            left = len(self._streams)
            if left:
                msg = f"the server is shutting down: drain timeout ({timeout_s:g} s) passed"
                self._commands.append(("fail", EngineStopped(msg), "shutdown"))
                self._cond.notify()
        return left

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after the current step; requests still in flight end with finish_reason 'abort'."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread = None
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
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
            self.metrics.request_done("abort")
            self._send_accept(stream, EngineStopped("the engine was shut down"))
            self._send(stream, self._final(stream, "abort"))

    # -- requests (event loop side) -------------------------------------------------
    def _check_prompt_size(self, prompt: Prompt) -> None:
        if isinstance(prompt, str):
            n, field = len(prompt), "prompt"
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            n, field = sum(len(str(m.get("content") or "")) for m in prompt), "messages"
        else:
            return
        if n > self.max_prompt_chars:
            raise ValueError(
                f"{field}: {n} characters is more than this server takes (max_prompt_chars "
                f"{self.max_prompt_chars}); the model's context is {self.max_context} tokens"
            )

    def _tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of text, token ids or chat messages (runs on the tokenizer thread)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.engine.chat_prompt(prompt)
        return self.engine.encode(prompt)

    async def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        fill_max_tokens: bool = False,
    ) -> RequestStream:
        """Tokenise (off the engine thread), queue a request and wait until the engine thread accepted it.

        ``prompt`` is text, token ids, or chat messages (a list of dicts, templated by the tokenizer).
        With ``fill_max_tokens`` the output budget becomes all the room the context and KV cache leave.
        Raises Overloaded (queue full), Rejected (can never run), ValueError naming the bad field,
        EngineStopped.
        """
        self._check_open()
        self._check_prompt_size(prompt)
        loop = asyncio.get_running_loop()
        rid = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, rid, loop)
        with self._cond:
            self._reserve(rid, stream)
        try:
            try:
                ids = await loop.run_in_executor(self._tokenizer_pool, self._tokenize, prompt)
            except BaseException:
                with self._cond:
                    self._streams.pop(rid, None)
                raise
            with self._cond:
                self._commands.append(("add", stream, ids, params or SamplingParams(), fill_max_tokens))
                self._cond.notify()
            await stream.accepted()
        except asyncio.CancelledError:
            self.abort(rid)
            raise
        return stream

    def _check_open(self) -> None:
        if not self.is_running:
            raise EngineStopped("the engine loop is not running")
        if self._draining:
            raise EngineStopped("the server is shutting down")

    def _reserve(self, rid: str, stream: RequestStream) -> None:
        """Take a queue slot for ``rid`` (under the lock)."""
        if len(self._streams) >= self.max_queue:
            self.metrics.request_done("overloaded")
            raise Overloaded(
                f"server overloaded: {len(self._streams)} requests waiting or running (max_queue "
                f"{self.max_queue}); retry later"
            )
        if rid in self._streams:
            raise ValueError(f"request_id: {rid!r} is already in use")
        self._streams[rid] = stream

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
                    self.error = exc
                    self._fail_all(RuntimeError(f"engine step failed: {exc}"), "error")
                    outputs = []
                sends = self._dispatch(outputs)
                self._publish_state()  # before the outputs go out: a client that got its answer sees it
                for stream, item in sends:
                    self._send(stream, item)
                if eng.instance.num_steps == steps_before and eng.has_unfinished():
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
        req = self.engine.requests.get(rid)
        self.engine.abort(rid)
        self._forget(rid)
        self.metrics.request_done(
            "abort",
            prefix_hit_tokens=req.prefix_hit_tokens if req else 0,
            num_prompt_tokens=req.num_prompt_tokens if req else 0,
        )
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
        capacity = self.engine.instance.load().kv_capacity_tokens
        return min(self.max_context - num_prompt_tokens, capacity - num_prompt_tokens + 1)

    def _dispatch(self, outputs) -> list[tuple[RequestStream, StreamOutput]]:
        """Account for a step's outputs; returns what to send to whom."""
        sends = []
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
                logprobs = list(req.output_logprobs[stream.logprobs_sent :])
                stream.logprobs_sent = len(req.output_logprobs)
            self.metrics.add_tokens(generation_tokens=len(out.new_token_ids))
            if out.finished:
                self._forget(out.request_id)
                self.metrics.request_done(
                    out.finish_reason or "stop",
                    req.ttft_s,
                    req.tpot_s,
                    req.e2e_s,
                    prefix_hit_tokens=req.prefix_hit_tokens,
                    num_prompt_tokens=req.num_prompt_tokens,
                )
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
        load = self.engine.instance.load()
        self.metrics.set_engine_state(load, kv_free_blocks=_free_blocks(self.engine.instance))


def _free_blocks(instance) -> int:
    """Blocks on the free list; ``InstanceLoad`` does not carry it, so read the pool if there is one."""
    pool = getattr(instance, "pool", None)
    return int(getattr(pool, "num_free", 0))
