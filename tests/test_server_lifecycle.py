"""Requests that end early: client disconnects, aborts reaching the engine, the drain timeout at shutdown.

The engine sleeps 20 ms per step, so a 400-token request needs at least 8 s: a test that sees it ABORTED
with fewer tokens knows the abort reached the engine, whatever the machine's speed (the waits for that
are bounds, not timings: a request that finished instead is FINISHED, and fails the test). Also: tokenising runs
off the engine thread, and stream timeouts work where ``asyncio.TimeoutError`` is not the builtin (3.10).
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from server_support import (  # noqa: E402
    live,
    make_engine,
    metric_values,
    sse_events,
    wait_for_state,
    wait_until_idle,
)

from kvbalance.request import RequestState  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")

LONG = 400  # output tokens: >= 8 s at 20 ms per step
STEP_DELAY_S = 0.02


@pytest.fixture(scope="module")
def slow_engine():
    return make_engine(step_delay_s=STEP_DELAY_S)


@pytest.fixture(scope="module")
def server(slow_engine):
    with live(slow_engine) as s:
        yield s


def _long_body(i: int, stream: bool) -> dict:
    return {"prompt": [i + 1] * (20 + i), "max_tokens": LONG, "ignore_eos": True, "stream": stream}


def _new_requests(engine, before: set) -> list:
    return [r for rid, r in engine.seen.items() if rid not in before]


def test_disconnect_mid_stream_aborts_the_request_in_the_engine_and_frees_its_kv(server, slow_engine):
    wait_until_idle(slow_engine)
    before = set(slow_engine.seen)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=_long_body(0, True)) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got == 3:
                    break
            (req,) = _new_requests(slow_engine, before)
            assert req.state is RequestState.RUNNING and slow_engine.instance.load().kv_used_tokens > 0
    wait_for_state(req, timeout_s=6.0)  # ABORTED, not FINISHED: it needed >= 8 s
    assert req.num_output_tokens < LONG and req.finish_reason != "length"
    wait_until_idle(slow_engine)
    slow_engine.instance.check_invariants()


def test_several_simultaneous_disconnects_streaming_and_not(server, slow_engine):
    wait_until_idle(slow_engine)
    before = set(slow_engine.seen)

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:

            async def streaming(i: int):
                async with c.stream("POST", "/v1/completions", json=_long_body(i, True)) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return  # leaving the block closes the connection

            async def plain(i: int):
                await c.post("/v1/completions", json=_long_body(i, False))

            tasks = [asyncio.ensure_future(streaming(i)) for i in range(3)]
            tasks += [asyncio.ensure_future(plain(i)) for i in range(3, 5)]
            await asyncio.gather(*tasks[:3])
            deadline = time.monotonic() + 5
            while len(_new_requests(slow_engine, before)) < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            for t in tasks[3:]:
                t.cancel()  # the client gives up on the non-streaming ones
            await asyncio.gather(*tasks[3:], return_exceptions=True)

    asyncio.run(go())
    reqs = _new_requests(slow_engine, before)
    assert len(reqs) == 5
    for req in reqs:
        wait_for_state(req, timeout_s=6.0)
        assert req.num_output_tokens < LONG
    wait_until_idle(slow_engine)
    slow_engine.instance.check_invariants()
    with httpx.Client(base_url=server.url) as c:
        m = metric_values(c)
    assert m['kvbalance_requests_total{finish_reason="abort"}'] >= 5


def test_async_engine_abort_reaches_the_engine():
    from kvbalance.request import SamplingParams
    from kvbalance.server.async_engine import AsyncEngine

    engine = make_engine(step_delay_s=STEP_DELAY_S)
    aengine = AsyncEngine(engine)
    aengine.start()

    async def go():
        stream = await aengine.submit([1, 2, 3], SamplingParams(max_tokens=LONG, ignore_eos=True), "r")
        await stream.next()
        stream.abort()
        return stream

    try:
        asyncio.run(go())
        req = engine.seen["r"]
        wait_for_state(req, timeout_s=6.0)
        assert req.num_output_tokens < LONG
        wait_until_idle(engine)
    finally:
        aengine.shutdown()


def test_shutdown_ends_running_streams_after_the_drain_timeout_with_an_error_and_done():
    engine = make_engine(step_delay_s=STEP_DELAY_S)
    with live(engine, drain_timeout_s=0.3) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=_long_body(0, True)) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            s.server.should_exit = True  # what SIGTERM does
            events = sse_events(lines)
        s.thread.join(15)
        assert not s.thread.is_alive()
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == 503 and "drain timeout" in err["message"]
    (req,) = engine.seen.values()
    assert req.state is RequestState.ABORTED and req.num_output_tokens < LONG
    assert s.server.num_cut_at_shutdown == 1


def test_shutdown_answers_a_waiting_non_streaming_request_503_after_the_drain_timeout():
    engine = make_engine(step_delay_s=STEP_DELAY_S)
    with live(engine, drain_timeout_s=0.3) as s:

        async def go():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                task = asyncio.ensure_future(c.post("/v1/completions", json=_long_body(0, False)))
                while not engine.seen:
                    await asyncio.sleep(0.01)
                s.server.should_exit = True
                return await task

        r = asyncio.run(go())
        s.thread.join(15)
    assert r.status_code == 503 and "drain timeout" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "server_error"
    (req,) = engine.seen.values()
    assert req.state is RequestState.ABORTED


def test_shutdown_lets_a_short_request_finish_within_the_drain_timeout():
    engine = make_engine()
    with live(engine, drain_timeout_s=10) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        body = {"prompt": [1, 2], "max_tokens": 30, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            s.server.should_exit = True
            events = sse_events(lines)
        s.thread.join(15)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 29  # the first one was read above
    assert s.server.num_cut_at_shutdown == 0


def test_tokenising_and_chat_templates_run_off_the_engine_thread(server, slow_engine):
    tok = slow_engine.tokenizer
    tok.encode_threads.clear()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1}).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
    assert len(tok.encode_threads) == 2
    assert all(name.startswith("kvbalance-tokenizer") for name in tok.encode_threads), tok.encode_threads


def test_stream_timeout_works_when_asyncio_timeout_is_not_the_builtin(monkeypatch):
    """Python 3.10: ``asyncio.wait_for`` raises ``asyncio.TimeoutError``, a class of its own."""
    from kvbalance.server import streams

    class Py310TimeoutError(Exception):
        pass

    async def wait_for(aw, timeout):
        task = asyncio.ensure_future(aw)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            task.cancel()
            raise Py310TimeoutError
        return task.result()

    monkeypatch.setattr(streams.asyncio, "TimeoutError", Py310TimeoutError)
    monkeypatch.setattr(streams.asyncio, "wait_for", wait_for)

    class NoEngine:
        def abort(self, request_id):
            pass

    async def go():
        stream = streams.RequestStream(NoEngine(), "r", asyncio.get_running_loop())
        return await stream.next(timeout=0.01)

    assert asyncio.run(go()) is None
