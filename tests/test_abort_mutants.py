"""The server's abort path, function by function, with stand-ins instead of a model (milliseconds each).

A client that goes away (``Choices`` polls ``is_disconnected``), an SSE body that stops early, a dropped
``generate`` iterator or an explicit ``RequestStream.abort()`` must reach ``AsyncEngine.abort``, which queues
``("abort", id)`` for the engine thread; there ``_apply`` -> ``_abort_now`` frees the request in
``LLMEngine.abort`` (``Instance.abort``: its KV blocks) and ends the stream with finish_reason ``abort``.
The live-server tests (tests/test_server_lifecycle.py) check the same path end to end; these pin each step.
A fake clock replaces ``time.monotonic`` inside ``streaming`` so the disconnect poll is deterministic.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from kvbalance.llm.engine import LLMEngine  # noqa: E402
from kvbalance.server import streaming  # noqa: E402
from kvbalance.server.async_engine import AsyncEngine  # noqa: E402
from kvbalance.server.engine_thread import EngineThread  # noqa: E402
from kvbalance.server.streaming import Choices, sse_response  # noqa: E402
from kvbalance.server.streams import EngineStopped, RequestStream, StreamOutput  # noqa: E402


class FakeEngine:
    """What a ``RequestStream`` calls back into: records the aborted ids."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class Http:
    """A request whose client is connected until ``gone`` is set; counts the polls."""

    def __init__(self, gone: bool = False) -> None:
        self.gone = gone
        self.polls = 0

    async def is_disconnected(self) -> bool:
        self.polls += 1
        return self.gone


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(streaming, "time", c)
    return c


def out(rid: str, tokens: list[int], finished: bool = False) -> StreamOutput:
    return StreamOutput(
        rid, tokens, "".join(chr(97 + t) for t in tokens), finished, "stop" if finished else None, 3, 1
    )


def stream(engine: FakeEngine, rid: str, items=()) -> RequestStream:
    s = RequestStream(engine, rid, asyncio.get_running_loop())
    for item in items:
        s.push(item)
    return s


# -- RequestStream.abort, LLMEngine.abort ------------------------------------------------------------------


def test_request_stream_abort_reaches_the_engine_once_and_not_after_the_end():
    async def go():
        eng = FakeEngine()
        s = stream(eng, "a")
        s.abort()
        assert s.finished and eng.aborted == ["a"]
        s.abort()
        assert eng.aborted == ["a"]  # already ended: a no-op
        done = stream(eng, "b", [out("b", [1], finished=True)])
        assert (await done.next()).finished and done.finished
        done.abort()
        assert eng.aborted == ["a"]
        with pytest.raises(StopAsyncIteration):
            await s.next()

    asyncio.run(go())


def test_llm_engine_abort_frees_a_running_request_and_forgets_it():
    calls = []
    running = SimpleNamespace(is_finished=False)
    finished = SimpleNamespace(is_finished=True)
    eng = object.__new__(LLMEngine)
    eng.requests = {"run": running, "done": finished, "other": running}
    eng._detok = {"run": "d1", "done": "d2", "other": "d3"}
    eng.instance = SimpleNamespace(abort=lambda req, now: calls.append((req, now)))
    eng.now = lambda: 7.5
    eng.abort("run")
    assert calls == [(running, 7.5)] and eng.requests == {"done": finished, "other": running}
    assert eng._detok == {"done": "d2", "other": "d3"}
    eng.abort("done")  # finished already: nothing to free in the instance, but forgotten
    assert calls == [(running, 7.5)] and eng.requests == {"other": running} and eng._detok == {"other": "d3"}
    eng.abort("unknown")
    assert calls == [(running, 7.5)] and eng.requests == {"other": running}


# -- AsyncEngine.abort, generate -----------------------------------------------------------------------------


class Cond:
    """A condition stand-in that counts notifications and checks they happen under the lock."""

    def __init__(self) -> None:
        self.held = False
        self.notified = 0

    def __enter__(self):
        self.held = True
        return self

    def __exit__(self, *exc):
        self.held = False

    def notify(self) -> None:
        assert self.held
        self.notified += 1


def bare_async_engine() -> AsyncEngine:
    a = object.__new__(AsyncEngine)
    a._cond = Cond()
    a._commands = []
    a._streams = {"r1": object()}
    return a


def test_async_engine_abort_queues_one_command_for_a_known_request():
    a = bare_async_engine()
    a.abort("nobody")
    assert a._commands == [] and a._cond.notified == 0  # unknown ids are ignored
    a.abort("r1")
    assert a._commands == [("abort", "r1")] and a._cond.notified == 1 and not a._cond.held


def test_generate_aborts_its_stream_however_the_caller_leaves():
    class Stream:
        def __init__(self, n: int) -> None:
            self.items = [out("g", [i], finished=i == n - 1) for i in range(n)]
            self.aborts = 0

        def __aiter__(self):
            return self

        async def __anext__(self):
            if not self.items:
                raise StopAsyncIteration
            return self.items.pop(0)

        def abort(self) -> None:
            self.aborts += 1

    made = []

    async def submit(prompt, params=None, request_id=None):
        made.append((prompt, params, request_id))
        made.append(Stream(3))
        return made[-1]

    a = object.__new__(AsyncEngine)
    a.submit = submit

    async def go():
        got = [o.new_token_ids async for o in a.generate([1, 2], "params", "rid")]
        assert got == [[0], [1], [2]] and made[0] == ([1, 2], "params", "rid") and made[1].aborts == 1
        gen = a.generate([3])
        first = await gen.__anext__()
        assert first.new_token_ids == [0] and made[3].aborts == 0
        await gen.aclose()  # the caller stops early (a client gone): the request is aborted
        assert made[3].aborts == 1

    asyncio.run(go())


# -- EngineThread._apply, _abort_now --------------------------------------------------------------------------


class Loop:
    def __init__(self, closed: bool = False) -> None:
        self.calls: list = []
        self.closed = closed

    def call_soon_threadsafe(self, fn, *args) -> None:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append((fn, args))


class Thread(EngineThread):
    def __init__(self) -> None:
        self._cond = Cond()
        self._streams = {}
        self.engine = SimpleNamespace(aborted=[], _detok={"x": 1, "y": 2})
        self.engine.abort = self.engine.aborted.append
        self.done: list[str] = []
        self.metrics = SimpleNamespace(request_done=self.done.append)


def test_apply_routes_each_command():
    seen = []

    class Recorder(EngineThread):
        def _abort_now(self, rid):
            seen.append(("abort", rid))

        def _fail_all(self, exc, reason):
            seen.append(("fail", exc, reason))

        def _add_now(self, *args):
            seen.append(("add", *args))

    r, exc = Recorder(), EngineStopped("bye")
    r._apply(("abort", "r7"))
    r._apply(("fail", exc, "shutdown"))
    r._apply(("add", "stream", [1, 2], "params", True))
    assert seen == [("abort", "r7"), ("fail", exc, "shutdown"), ("add", "stream", [1, 2], "params", True)]


def test_abort_now_frees_the_request_and_ends_its_stream_with_reason_abort():
    t = Thread()
    s = SimpleNamespace(request_id="x", prompt_token_ids=[5, 6, 7], _loop=Loop(), push=lambda item: None)
    t._streams = {"x": s, "y": object()}
    t._abort_now("x")
    assert t._streams.keys() == {"y"} and t.engine.aborted == ["x"] and t.done == ["abort"]
    assert t.engine._detok == {"y": 2} and not t._cond.held
    ((fn, (item,)),) = s._loop.calls
    assert fn is s.push and item == StreamOutput("x", [], "", True, "abort", 3, 0)
    t._abort_now("x")  # gone already (finished or aborted twice): nothing more happens
    assert t.engine.aborted == ["x"] and t.done == ["abort"] and len(s._loop.calls) == 1
    closed = SimpleNamespace(request_id="z", prompt_token_ids=[], _loop=Loop(closed=True), push=None)
    t._streams["z"] = closed
    t._abort_now("z")  # the caller's loop is closed: still freed in the engine
    assert t.engine.aborted == ["x", "z"] and t.done == ["abort", "abort"]


# -- Choices: the disconnect poll -------------------------------------------------------------------------------


def test_collect_gathers_every_choice_and_aborts_nothing_that_finished(clock):
    async def go():
        eng, http = FakeEngine(), Http()
        a = stream(eng, "a", [out("a", [1]), out("a", [2], finished=True)])
        b = stream(eng, "b", [out("b", [3], finished=True)])
        got = await Choices([a, b], http).collect()
        assert {i: [o.new_token_ids for o in outs] for i, outs in got.items()} == {0: [[1], [2]], 1: [[3]]}
        assert eng.aborted == [] and http.polls == 0  # items kept flowing and no poll interval passed
        assert await Choices([], http).collect() == {}

    asyncio.run(go())


def test_a_client_gone_while_nothing_arrives_aborts_every_open_choice(clock, monkeypatch):
    monkeypatch.setattr(streaming, "DISCONNECT_POLL_S", 0.01)

    async def go():
        eng, http = FakeEngine(), Http(gone=True)
        done = stream(eng, "done", [out("done", [1], finished=True)])
        idle = stream(eng, "idle")  # never produces: the wait times out and the client is polled
        ch = Choices([done, idle], http)
        assert await ch.collect() is None
        assert eng.aborted == ["idle"] and http.polls >= 1
        await asyncio.gather(*ch._pumps, ch._getter, return_exceptions=True)
        assert ch._pumps[1].cancelled() and ch._getter.cancelled()

    asyncio.run(go())


def test_the_client_is_polled_once_the_interval_passes_even_while_outputs_flow(clock):
    async def go():
        eng, http = FakeEngine(), Http(gone=True)
        busy = stream(eng, "busy", [out("busy", [i]) for i in range(5)])
        ch = Choices([busy], http)
        assert (await ch.next())[1].new_token_ids == [0]  # no time has passed: no poll
        assert http.polls == 0
        clock.t += streaming.DISCONNECT_POLL_S  # exactly one interval: poll
        assert await ch.next() is None and http.polls == 1
        ch.abort()
        assert eng.aborted == ["busy"]

    asyncio.run(go())


def test_a_connected_client_is_polled_and_the_interval_restarts(clock):
    async def go():
        eng, http = FakeEngine(), Http()
        busy = stream(eng, "busy", [out("busy", [i]) for i in range(4)])
        ch = Choices([busy], http)
        clock.t += 0.375  # binary fractions: the differences below are exact
        assert (await ch.next())[1].new_token_ids == [0] and http.polls == 1
        assert (await ch.next())[1].new_token_ids == [1] and http.polls == 1  # checked just now
        clock.t += 0.125
        assert (await ch.next())[1].new_token_ids == [2] and http.polls == 1
        clock.t += 0.125  # 0.25 since the last poll
        assert (await ch.next())[1].new_token_ids == [3] and http.polls == 2
        ch.abort()

    asyncio.run(go())


def test_an_engine_failure_in_one_choice_is_raised_and_ends_that_choice(clock):
    async def go():
        eng = FakeEngine()
        err = RuntimeError("engine step failed: boom")
        a = stream(eng, "a", [err])
        b = stream(eng, "b", [out("b", [4], finished=True)])
        ch = Choices([a, b], Http())
        items = []
        with pytest.raises(RuntimeError, match="boom"):
            while True:
                items.append(await ch.next())
        assert ch._open == 1  # the failed choice is closed, the other one still counts
        rest = [await ch.next()]
        with pytest.raises(StopAsyncIteration):
            await ch.next()
        assert [i for i, _ in items + rest] == [1] and ch._open == 0
        ch.abort()
        assert eng.aborted == []

    asyncio.run(go())


def test_a_failed_choice_among_three_leaves_two_open(clock):
    async def go():
        eng = FakeEngine()
        bad = stream(eng, "bad", [RuntimeError("boom")])
        ok = [stream(eng, r, [out(r, [5], finished=True)]) for r in ("b", "c")]
        ch = Choices([bad, *ok], Http())
        with pytest.raises(RuntimeError, match="boom"):
            await ch.next()
        assert ch._open == 2
        rest = [(await ch.next())[0], (await ch.next())[0]]
        with pytest.raises(StopAsyncIteration):
            await ch.next()
        assert rest == [1, 2]

    asyncio.run(go())


def test_abort_cancels_the_pumps_and_the_pending_getter(clock, monkeypatch):
    monkeypatch.setattr(streaming, "DISCONNECT_POLL_S", 0.001)

    async def go():
        eng, http = FakeEngine(), Http()
        ch = Choices([stream(eng, "p"), stream(eng, "q")], http)
        waiter = asyncio.ensure_future(ch.next())
        while http.polls < 2:  # waiting on an empty queue, polling the client
            await asyncio.sleep(0.001)
        getter = ch._getter
        ch.abort()
        waiter.cancel()
        await asyncio.gather(*ch._pumps, getter, waiter, return_exceptions=True)
        assert eng.aborted == ["p", "q"] and getter.cancelled() and all(p.cancelled() for p in ch._pumps)

    asyncio.run(go())


# -- sse_response ---------------------------------------------------------------------------------------------------


async def body(response) -> list[str]:
    return [part async for part in response.body_iterator]


def test_sse_stream_writes_prelude_chunks_closing_and_done(clock):
    async def go():
        eng = FakeEngine()
        s = stream(eng, "s", [out("s", [1]), out("s", [2], finished=True)])
        resp = sse_response(
            Choices([s], Http()),
            lambda i, o: {"i": i, "t": o.new_token_ids},
            lambda: [{"usage": 2}],
            prelude=[{"role": "assistant"}],
        )
        assert resp.media_type == "text/event-stream" and resp.headers["cache-control"] == "no-cache"
        assert await body(resp) == [
            'data: {"role":"assistant"}\n\n',
            'data: {"i":0,"t":[1]}\n\n',
            'data: {"i":0,"t":[2]}\n\n',
            'data: {"usage":2}\n\n',
            "data: [DONE]\n\n",
        ]
        assert eng.aborted == []

    asyncio.run(go())


def test_sse_stream_stops_without_done_when_the_client_goes_and_aborts(clock):
    async def go():
        eng, http = FakeEngine(), Http(gone=True)
        s = stream(eng, "s", [out("s", [1]), out("s", [2])])
        ch = Choices([s], http)
        resp = sse_response(ch, lambda i, o: {"t": o.new_token_ids}, lambda: [{"usage": 0}])
        it = resp.body_iterator
        assert await it.__anext__() == 'data: {"t":[1]}\n\n'
        clock.t += 1.0
        with pytest.raises(StopAsyncIteration):
            await it.__anext__()
        assert eng.aborted == ["s"] and http.polls == 1

    asyncio.run(go())


def test_sse_stream_reports_a_failure_in_band_then_done_and_aborts_the_rest(clock):
    async def go():
        eng = FakeEngine()
        bad = stream(eng, "bad", [EngineStopped("the server is shutting down")])
        other = stream(eng, "other")
        resp = sse_response(Choices([bad, other], Http()), lambda i, o: {}, lambda: [])
        parts = await body(resp)
        assert parts[-1] == "data: [DONE]\n\n" and len(parts) == 2
        assert '"message":"the server is shutting down"' in parts[0] and "503" in parts[0]
        assert eng.aborted == ["other"]
        failing_closing = sse_response(Choices([], Http()), lambda i, o: {}, lambda: [1 / 0])
        parts = await body(failing_closing)
        assert len(parts) == 2 and "division by zero" in parts[0] and parts[1] == "data: [DONE]\n\n"

    asyncio.run(go())
