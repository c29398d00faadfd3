"""A bounded property-based fuzz of the HTTP API: no body makes a 5xx, and the server stays healthy.

Hypothesis builds bodies from the fields the API knows, with values of every JSON type (huge ints, NaN,
Infinity, lone surrogates, nested junk) and raw byte strings; derandomised, so every run sends the same
examples. Output budgets stay tiny so the whole fuzz takes seconds. Floats are drawn without subnormals:
the native kernels are built with -ffast-math, which flushes denormals process-wide once loaded, and
hypothesis refuses to draw subnormals then.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from server_support import live_server, make_engine, wait_until_idle  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")

FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

text = st.text(st.characters(codec="utf-8") | st.characters(categories=["Cs"]), max_size=12)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 30)
    | st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False)
    | text
)
junk = st.recursive(
    scalars, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(text, ch, max_size=3), max_leaves=6
)
small_budget = st.integers(1, 3) | st.sampled_from(["2", 2.5, True, 0, -1, 10**30])  # no None: chat fills
token_ids = st.lists(st.integers(-2, 300), min_size=0, max_size=6)
prompt = text | token_ids | st.lists(text | token_ids, max_size=3) | junk
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "wizard"]) | junk},
    optional={"content": text | junk, "name": text},
)
common = {
    "temperature": junk | st.floats(0, 3, allow_subnormal=False),
    "top_p": junk | st.floats(0, 1, allow_subnormal=False),
    "top_k": junk | st.integers(-2, 300) | st.integers(2**31 - 2, 2**70),
    "seed": junk,
    "stop": junk,
    "stream": st.booleans() | junk,
    "stream_options": junk | st.just({"include_usage": True}),
    "n": st.integers(-1, 3) | junk,
    "presence_penalty": junk | st.floats(-3, 3, allow_subnormal=False),
    "frequency_penalty": junk | st.floats(-3, 3, allow_subnormal=False),
    "logit_bias": junk
    | st.dictionaries(st.integers(-1, 300).map(str), st.floats(-150, 150, allow_subnormal=False), max_size=3),
    "model": st.just("tiny-llama") | junk,
    "ignore_eos": st.booleans() | junk,
    "stop_token_ids": token_ids | junk,
    "user": junk,
    "response_format": junk | st.just({"type": "text"}),
}
completion_body = st.fixed_dictionaries(
    {"prompt": prompt, "max_tokens": small_budget},
    optional={
        **common,
        "logprobs": junk | st.integers(-1, 25),
        "echo": st.booleans() | junk,
        "best_of": junk,
    },
)
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=3) | junk, "max_tokens": small_budget},
    optional={**common, "logprobs": st.booleans() | junk, "top_logprobs": junk | st.integers(-1, 25)},
)


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.fixture(scope="module")
def client(engine):
    with live_server(engine, max_queue=8) as url, httpx.Client(base_url=url, timeout=30) as c:
        yield c
    engine.instance.check_invariants()


def _check(r) -> None:
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events[:-1])
    else:
        assert r.json()["choices"]


def _post(client, path: str, body) -> None:
    raw = json.dumps(body).encode()  # lone surrogates go out as \\ud800 escapes, NaN as NaN
    _check(client.post(path, content=raw, headers={"content-type": "application/json"}))


@FUZZ
@given(body=completion_body)
def test_fuzzed_completion_bodies_never_5xx(client, body):
    _post(client, "/v1/completions", body)


@FUZZ
@given(body=chat_body)
def test_fuzzed_chat_bodies_never_5xx(client, body):
    _post(client, "/v1/chat/completions", body)


@settings(FUZZ, max_examples=25)
@given(raw=st.binary(max_size=48), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_raw_bytes_never_5xx(client, raw, path):
    _check(client.post(path, content=raw, headers={"content-type": "application/json"}))


def test_server_is_healthy_after_the_fuzz(client, engine):
    wait_until_idle(engine)
    assert client.get("/health").json() == {"status": "ok", "in_flight": 0}
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
