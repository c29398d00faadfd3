"""What the engine thread hands back to asyncio callers: per-request output streams and refusals.

``RequestStream`` is one submitted request's outputs in order, delivered on the event loop that submitted
it (the engine thread only ever touches it through ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbalance.request import Request

if TYPE_CHECKING:
    from kvbalance.server.async_engine import AsyncEngine


class Overloaded(RuntimeError):
    """Waiting plus running requests reached ``max_queue`` (the HTTP layer answers 429)."""


class EngineStopped(RuntimeError):
    """The engine loop is not running (never started, shut down, draining, or crashed)."""


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


def _timeout_errors() -> tuple[type[BaseException], ...]:
    # asyncio.wait_for raises asyncio.TimeoutError, which is the builtin TimeoutError only from 3.11 on.
    return (TimeoutError, asyncio.TimeoutError)


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
        self.logprobs_sent = 0  # engine thread only

    # -- engine thread side (always through call_soon_threadsafe) ---------------------
    def push(self, item: StreamOutput | BaseException) -> None:
        self._items.append(item)
        self._event.set()

    def resolve(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    # -- consumer side ------------------------------------------------------------------
    async def accepted(self) -> None:
        await self._accepted

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
                except _timeout_errors():
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
