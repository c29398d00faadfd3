"""A bounded property-based fuzz of the HTTP API: no body makes a 5xx, and the server stays healthy.

Hypothesis builds mostly valid bodies from the fields the API knows (text may hold lone surrogates), with
at most one field replaced by a value of any JSON type (huge ints, NaN, Infinity, nested junk) or an
unknown field added, plus raw byte strings; derandomised, so every run sends the same examples. Output budgets stay tiny so the whole fuzz takes seconds. Floats are drawn without subnormals:
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
from server_support import byte_tokenizer, live_server, make_engine, wait_until_idle  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")

FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

clean_text = st.text(st.characters(codec="utf-8"), max_size=12)
text = clean_text | st.text(
    st.characters(codec="utf-8") | st.characters(categories=["Cs"]), min_size=1, max_size=4
)
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
token_ids = st.lists(st.integers(0, 255), min_size=1, max_size=6)


def floats(lo: float, hi: float):
    return st.floats(lo, hi, allow_subnormal=False)


# Mostly valid bodies (so they reach tokenising, sampling and streaming), each with at most one field
# replaced by junk or an unknown field added, and text that may hold lone surrogates.
VALID_COMMON = {
    "temperature": floats(0, 3) | st.sampled_from([1e-40, 1e-6, 50.0]),
    "top_p": floats(0.01, 1),
    "top_k": st.integers(-1, 300),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": text | st.lists(text, max_size=3),
    "stream": st.booleans(),
    "n": st.integers(1, 3),
    "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), floats(-100, 100), max_size=3),
    "model": st.just("tiny-llama"),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=3),
    "user": clean_text,
    "response_format": st.just({"type": "text"}),
}
VALID_COMPLETION = {
    **VALID_COMMON,
    "logprobs": st.integers(0, 20),
    "echo": st.booleans(),
    "prompt": text | token_ids | st.lists(clean_text | token_ids, min_size=1, max_size=3),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"])}, optional={"content": text, "name": clean_text}
)
VALID_CHAT = {
    **VALID_COMMON,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "messages": st.lists(message, min_size=1, max_size=3),
}


def bodies(fields: dict, required: tuple[str, ...]):
    optional = {k: v for k, v in fields.items() if k not in required}
    base = st.fixed_dictionaries(
        {"max_tokens": st.integers(1, 3), **{k: fields[k] for k in required}}, optional=optional
    )
    names = st.sampled_from([*fields, "max_tokens", "best_of", "stream_options", "unknown_field"])
    corrupt = st.none() | st.tuples(names, junk | st.sampled_from(["2", 2.5, True, 0, -1, 10**30]))

    def apply(pair):
        body, bad = pair
        if bad is not None:
            body[bad[0]] = bad[1]
        if body.get("max_tokens") is None or body.get("max_tokens") == 10**30 and "messages" in body:
            body["max_tokens"] = 1  # never let chat fill the whole context: the fuzz must stay quick
        return body

    return st.tuples(base, corrupt).map(apply)


completion_body = bodies(VALID_COMPLETION, ("prompt",))
chat_body = bodies(VALID_CHAT, ("messages",))


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("transformers")
    return make_engine(byte_tokenizer())  # a real HF tokenizer: it raises on lone surrogates


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
