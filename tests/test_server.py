"""The OpenAI-compatible server, live on loopback over the tiny random model with a fake tokenizer."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from kvbalance.llm import LLMEngine  # noqa: E402
from kvbalance.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")


class CharTokenizer:
    """Tokenizer stand-in for a 256-token vocab: one id per character, printable ASCII on the way back."""

    eos_token_id = None
    chat_template = "<role>content..."

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x20 + int(i) % 95) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def make_engine() -> LLMEngine:
    engine = LLMEngine(model="tiny-llama", kv_cache_tokens=4096, max_num_batched_tokens=256, num_threads=1)
    engine.tokenizer = CharTokenizer()
    return engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(engine: LLMEngine, max_queue: int = 64):
    """Run the app with uvicorn in a thread on a free loopback port; yield its base URL."""
    app = create_app(engine, "tiny-llama", max_queue=max_queue)
    config = uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def kv_blocks_held(engine: LLMEngine) -> int:
    """Blocks held by requests: all blocks minus free ones minus cached-but-idle (evictable) ones."""
    inst = engine.instance
    evictable = inst.cache.evictable_blocks if inst.cache is not None else 0
    return inst.pool.num_blocks - inst.pool.num_free - evictable


def wait_until_idle(engine: LLMEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sched = engine.instance.scheduler
        if sched.num_running == 0 and sched.num_waiting == 0 and kv_blocks_held(engine) == 0:
            return
        time.sleep(0.02)
    raise AssertionError(
        f"engine still busy: running={engine.instance.scheduler.num_running}, "
        f"waiting={engine.instance.scheduler.num_waiting}, blocks held={kv_blocks_held(engine)}"
    )


def sse_events(response) -> list:
    """Parse ``data: ...`` lines of a server-sent-event stream; ``[DONE]`` is kept as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.fixture(scope="module")
def base_url(engine):
    with live_server(engine) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c


# -- plain endpoints -----------------------------------------------------------------------------
def test_health_and_models(client):
    assert client.get("/health").json()["status"] == "ok"
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny-llama"
    assert card["max_model_len"] == 512 and card["vocab_size"] == 256


def test_completion_with_token_ids_returns_tokens_and_usage(client, engine):
    r = client.post(
        "/v1/completions",
        json={"prompt": list(range(1, 21)), "max_tokens": 7, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion"
    assert len(choice["token_ids"]) == 7 and choice["finish_reason"] == "length"
    assert len(choice["text"]) == 7  # one character per token with the fake tokenizer
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27}
    wait_until_idle(engine)


def test_completion_logprobs(client):
    r = client.post(
        "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 2, "temperature": 0}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and len(lp["token_logprobs"]) == 3
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    assert all(v <= 0 for v in lp["token_logprobs"])


def test_seeded_text_completion_is_reproducible_and_stop_string_cuts_it(client):
    # a hot temperature, so the random model's text varies from token to token
    req = {
        "prompt": "The quick brown fox",
        "max_tokens": 24,
        "temperature": 20.0,
        "seed": 7,
        "ignore_eos": True,
    }
    first = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    again = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    assert first == again and len(first) == 24
    stop = first[10]
    cut = first.find(stop)
    r = client.post("/v1/completions", json={**req, "stop": [stop]}).json()["choices"][0]
    assert r["text"] == first[:cut]
    assert r["finish_reason"] == "stop"


def test_streaming_completion_matches_the_non_streaming_text(client):
    req = {"prompt": "hello", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    with client.stream(
        "POST", "/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 9
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)
    assert events[-2]["usage"]["completion_tokens"] == 9


def test_chat_completion_and_chat_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(msg["content"]) == 5
    prompt_len = len(CharTokenizer().apply_chat_template(msgs))
    assert body["usage"]["prompt_tokens"] == prompt_len and body["usage"]["completion_tokens"] == 5

    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": msgs, "max_tokens": 5, "temperature": 0, "stream": True},
    ) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_are_batched_together(base_url, engine):
    import asyncio

    async def go():
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
            reqs = [
                c.post("/v1/completions", json={"prompt": [i + 1] * 8, "max_tokens": 12, "ignore_eos": True})
                for i in range(4)
            ]
            return await asyncio.gather(*reqs)

    before = len(engine.step_log)
    results = asyncio.run(go())
    assert all(r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 12 for r in results)
    assert max(seqs for _, seqs, _, _ in engine.step_log[before:]) > 1
    wait_until_idle(engine)


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "stop": 3}, "stop"),
        ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_malformed_request_is_400_naming_the_field(client, path, body, field):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field
    assert err["message"].startswith(f"{field}: ")


def test_bad_max_tokens_message(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.json()["error"]["message"].startswith("max_tokens: must be >= 1")


def test_invalid_json_is_400(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_prompt_longer_than_the_context_is_400_naming_prompt(client, engine):
    r = client.post("/v1/completions", json={"prompt": [1] * 600, "max_tokens": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and "context" in err["message"]
    r = client.post("/v1/completions", json={"prompt": [300], "max_tokens": 4})  # outside the 256-token vocab
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    wait_until_idle(engine)


def test_unknown_model_is_404(client):
    r = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-7"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# -- load and disconnects --------------------------------------------------------------------------
def test_full_queue_answers_429():
    engine = make_engine()
    with live_server(engine, max_queue=1) as url, httpx.Client(base_url=url, timeout=30) as c:
        long_req = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=long_req) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it is running
            busy = c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
            assert busy.status_code == 429
            assert busy.json()["error"]["type"] == "rate_limit_error"
        wait_until_idle(engine)  # leaving the stream aborted the long request
        ok = c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert ok.status_code == 200


def test_client_disconnect_mid_stream_frees_kv_blocks(base_url, engine):
    wait_until_idle(engine)
    req = {"prompt": list(range(1, 100)), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base_url, timeout=30) as c, c.stream("POST", "/v1/completions", json=req) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got == 3:
                break
        assert engine.instance.scheduler.num_running == 1
        assert kv_blocks_held(engine) > 0
    wait_until_idle(engine)  # pool.num_free + evictable == num_blocks
    inst = engine.instance
    assert inst.pool.num_free + inst.cache.evictable_blocks == inst.pool.num_blocks
    inst.check_invariants()


def test_metrics_endpoint_exposes_gauges_counters_and_histograms(client):
    client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "kvbalance_num_requests_running",
        "kvbalance_num_requests_waiting",
        "kvbalance_kv_used_tokens",
        "kvbalance_kv_capacity_tokens 4096",
        "kvbalance_prefix_cache_hit_rate",
        "kvbalance_preemptions_total",
        "kvbalance_generation_tokens_total",
        'kvbalance_requests_total{finish_reason="length"}',
        'kvbalance_time_to_first_token_seconds_bucket{le="+Inf"}',
        "kvbalance_time_per_output_token_seconds_count",
        "# TYPE kvbalance_time_to_first_token_seconds histogram",
    ):
        assert name in text, name
