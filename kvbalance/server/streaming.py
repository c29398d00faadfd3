"""The choices of one HTTP request (prompts x n engine requests), streamed as SSE or collected.

``Choices`` merges several ``RequestStream``s in arrival order, tagged with their choice index, and checks
every ``DISCONNECT_POLL_S`` that the client is still there; a client that goes away gets every one of its
requests aborted (KV blocks freed). ``sse_response`` writes a prelude, a chunk per output, closing chunks
and ``[DONE]``; a failure after the status line has gone out (an engine error, the drain timeout at
shutdown) is an in-band error event, still followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvbalance.server.errors import in_band_error
from kvbalance.server.streams import RequestStream, StreamOutput

DISCONNECT_POLL_S = 0.25  # how often a request in flight checks that its client is still there
DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Choices:
    """Outputs of several streams as ``(index, output)`` in arrival order; ``abort()`` ends them all."""

    def __init__(self, streams: Sequence[RequestStream], http: Request) -> None:
        self.streams = list(streams)
        self.http = http
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(self.streams)
        self._pumps = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self.streams)]
        self._getter: asyncio.Future | None = None
        self._last_check = time.monotonic()

    async def _pump(self, index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
        except StopAsyncIteration:
            pass
        except Exception as exc:  # an engine failure: hand it to the consumer
            self._queue.put_nowait((index, exc))
            return
        self._queue.put_nowait((index, None))

    async def _client_gone(self) -> bool:
        self._last_check = time.monotonic()
        return await self.http.is_disconnected()

    async def next(self) -> tuple[int, StreamOutput] | None:
        """The next output; None once the client has gone away; StopAsyncIteration when all have ended."""
        while True:
            if self._open == 0:
                raise StopAsyncIteration
            if self._getter is None:
                self._getter = asyncio.ensure_future(self._queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=DISCONNECT_POLL_S)
            if not done or time.monotonic() - self._last_check >= DISCONNECT_POLL_S:
                if await self._client_gone():
                    return None
            if not done:
                continue
            index, item = self._getter.result()
            self._getter = None
            if item is None:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                self._open -= 1
                raise item
            return index, item

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()
        for pump in self._pumps:
            pump.cancel()
        if self._getter is not None:
            self._getter.cancel()

    async def collect(self) -> dict[int, list[StreamOutput]] | None:
        """Every output of every choice (None if the client went away first; then all are aborted)."""
        outs: dict[int, list[StreamOutput]] = {i: [] for i in range(len(self.streams))}
        try:
            while True:
                try:
                    item = await self.next()
                except StopAsyncIteration:
                    return outs
                if item is None:
                    return None
                outs[item[0]].append(item[1])
        finally:
            self.abort()


def merge(outs: list[StreamOutput]) -> StreamOutput:
    """One choice's outputs as a single one (all tokens, text and logprobs)."""
    last = outs[-1]
    return StreamOutput(
        last.request_id,
        [t for o in outs for t in o.new_token_ids],
        "".join(o.text_delta for o in outs),
        last.finished,
        last.finish_reason,
        last.num_prompt_tokens,
        max(o.num_output_tokens for o in outs),
        [lp for o in outs for lp in o.logprobs],
    )


def sse_response(
    choices: Choices,
    chunk: Callable[[int, StreamOutput], dict],
    closing: Callable[[], Sequence[dict]],
    prelude: Sequence[dict] = (),
) -> StreamingResponse:
    """Server-sent events: ``prelude``, ``chunk(index, output)`` per output, ``closing()``, ``[DONE]``."""

    async def events() -> AsyncIterator[str]:
        try:
            for obj in prelude:
                yield sse(obj)
            while True:
                try:
                    item = await choices.next()
                except StopAsyncIteration:
                    break
                if item is None:
                    return  # client gone: finally aborts every choice
                yield sse(chunk(*item))
            for obj in closing():
                yield sse(obj)
            yield DONE
        except Exception as exc:
            yield sse(in_band_error(exc))
            yield DONE
        finally:
            choices.abort()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
