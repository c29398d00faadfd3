"""AsyncEngine: one background thread drives ``LLMEngine.step()``; asyncio callers stream their tokens.

Every scheduler and KV-cache call (adding, aborting, stepping) happens on the engine thread, so they never
see two threads. Tokenising and chat templates run before that, on tokenizer threads of their own, so a
huge prompt delays only its own request, never the running streams: prompts up to ``SMALL_PROMPT_CHARS``
characters have a thread to themselves, longer ones queue on another, so a small request never waits
behind a big one; and a prompt is refused before the expensive work when it is over an input budget — the
characters (``max_prompt_chars``), the token ids given (the context), and its tokens, counted piece by
piece only until they pass the context (``server.budget``), before any chat template runs. Callers hand the engine thread
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
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbalance.request import SamplingParams
from kvbalance.server.backend import as_backend
from kvbalance.server.budget import tokens_over_budget
from kvbalance.server.engine_thread import EngineThread
from kvbalance.server.metrics import ServerMetrics
from kvbalance.server.streams import EngineStopped, Overloaded, RequestStream, StreamOutput

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | list[dict[str, Any]]  # text, token ids, or chat messages
DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN = 32  # text longer than this x the context cannot fit it in practice
SMALL_PROMPT_CHARS = 16_384  # prompts up to this many characters tokenise on their own thread


class AsyncEngine(EngineThread):
    """Continuous batching of concurrent asyncio callers over one ``LLMEngine`` (or another
    ``server.backend.Backend``, e.g. a cluster of instances) on one thread.

    ``max_queue`` bounds requests waiting or running (more: Overloaded); ``max_prompt_chars`` bounds the
    text handed to the tokenizer (default: 32 characters per token of context).
    """

    def __init__(self, engine, max_queue: int = 256, max_prompt_chars: int | None = None) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue: must be an int >= 1, got {max_queue!r}")
        engine = as_backend(engine)
        if max_prompt_chars is None:
            max_prompt_chars = DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN * engine.max_context
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
        self._tokenizer_pool: ThreadPoolExecutor | None = None  # small prompts
        self._bulk_tokenizer_pool: ThreadPoolExecutor | None = None  # the rest, one at a time
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
        return self.engine.max_context

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

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
        self._bulk_tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="kvbalance-tokenizer-bulk")
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
        for pool in (self._tokenizer_pool, self._bulk_tokenizer_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
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
    def _check_prompt_size(self, prompt: Prompt) -> int:
        """Refuse a prompt over the character budget or with more token ids than the context (cheap: no
        tokenising); returns its size in characters (token ids: 0), which picks its tokenizer thread."""
        if isinstance(prompt, str):
            n, field = len(prompt), "prompt"
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            n, field = sum(len(str(m.get("content") or "")) for m in prompt), "messages"
        else:
            if len(prompt) > self.max_context:
                raise ValueError(
                    f"prompt: {len(prompt)} token ids is more than the model's context ({self.max_context} tokens)"
                )
            return 0
        if n > self.max_prompt_chars:
            raise ValueError(
                f"{field}: {n} characters is more than this server takes (max_prompt_chars "
                f"{self.max_prompt_chars}); the model's context is {self.max_context} tokens"
            )
        return n

    def _check_token_budget(self, prompt: Prompt, chat: bool) -> None:
        """Refuse text that surely tokenises to more than the context, counting no further than that."""
        texts = [str(m.get("content") or "") for m in prompt] if chat else [prompt]
        counted = tokens_over_budget(self.engine.encode, texts, self.max_context)
        if counted is not None:
            field = "messages" if chat else "prompt"
            raise ValueError(
                f"{field}: more than {self.max_context} tokens (counting stopped at {counted}); the model's "
                f"context is {self.max_context} tokens"
            )

    def _tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of text, token ids or chat messages (runs on the tokenizer thread).

        A tokenizer or chat template that raises (a template refusing the roles' order, say) is the
        request's fault: ValueError naming the field.
        """
        chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        try:
            if chat or isinstance(prompt, str):
                self._check_token_budget(prompt, bool(chat))
            return self.engine.chat_prompt(prompt) if chat else self.engine.encode(prompt)
        except ValueError:
            raise
        except Exception as exc:
            what = "messages: the chat template" if chat else "prompt: the tokenizer"
            raise ValueError(f"{what} refused it ({type(exc).__name__}: {exc})") from exc

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
        size = self._check_prompt_size(prompt)
        pool = self._tokenizer_pool if size <= SMALL_PROMPT_CHARS else self._bulk_tokenizer_pool
        loop = asyncio.get_running_loop()
        rid = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, rid, loop)
        with self._cond:
            self._reserve(rid, stream)
        try:
            try:
                ids = await loop.run_in_executor(pool, self._tokenize, prompt)
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
