"""The server under bad input and hostile clients: every error is OpenAI-shaped JSON, 4xx for the client.

The engine's tokenizer here is a real byte-level BPE (256 byte tokens), which, like every HF tokenizer,
raises on a lone surrogate, and whose partial UTF-8 tokens all decode to U+FFFD.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from server_support import byte_tokenizer, live_server, make_engine, metric_values, wait_until_idle  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine():
    return make_engine(byte_tokenizer())


@pytest.fixture(scope="module")
def base_url(engine):
    with live_server(engine, max_body_bytes=64 * 1024) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c


def assert_openai_error(r, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["type"] == ("server_error" if status >= 500 else err["type"])
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param and err["message"].startswith(f"{param}: "), err
    return err


def post_raw(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers={"content-type": "application/json"})


# -- lone surrogates and malformed JSON ---------------------------------------------------------------
@pytest.mark.parametrize(
    "path, raw, field",
    [
        (COMPLETIONS, b'{"prompt": "ab\\ud800", "max_tokens": 2}', "prompt"),
        (COMPLETIONS, b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
        (COMPLETIONS, b'{"prompt": "x", "stop": ["\\ud800"]}', "stop.0"),
        (COMPLETIONS, b'{"prompt": "x", "model": "\\ud800"}', "model"),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
            "messages.0.content",
        ),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "user": "\\udbff"}', "user"),
        (COMPLETIONS, b'{"prompt": "x", "\\ud800": 1}', "\\ud800"),
        (CHAT, b'{"messages": [{"role": "user", "\\ud800x": "x"}]}', "messages.0.\\ud800x"),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(client, path, raw, field):
    assert_openai_error(post_raw(client, path, raw), 400, field)


def test_malformed_json_names_the_body_with_the_offset_in_the_message(client):
    err = assert_openai_error(post_raw(client, COMPLETIONS, b'{"prompt": "x",, }'), 400, "body")
    assert "invalid JSON at byte 15" in err["message"]
    assert_openai_error(post_raw(client, COMPLETIONS, b"[1, 2]"), 400, "body")
    assert_openai_error(post_raw(client, COMPLETIONS, b""), 400, "body")


# -- strict numbers and booleans -------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw, field",
    [
        (b'{"prompt": "x", "max_tokens": "3"}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 2.5}', "max_tokens"),
        (b'{"prompt": "x", "stream": "true"}', "stream"),
        (b'{"prompt": "x", "stream": 1}', "stream"),
        (b'{"prompt": "x", "temperature": "0.5"}', "temperature"),
        (b'{"prompt": "x", "temperature": Infinity}', "temperature"),
        (b'{"prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"prompt": "x", "top_p": -Infinity}', "top_p"),
        (b'{"prompt": "x", "seed": 100000000000000000000000000000000}', "seed"),
        (b'{"prompt": "x", "seed": "7"}', "seed"),
        (b'{"prompt": "x", "ignore_eos": "yes"}', "ignore_eos"),
        (b'{"prompt": [1, true]}', "prompt"),
        (b'{"prompt": "x", "presence_penalty": 2.5}', "presence_penalty"),
        (b'{"prompt": "x", "logit_bias": {"5": 101}}', "logit_bias"),
        (b'{"prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias"),
        (b'{"prompt": "x", "logit_bias": {"999": 1}}', "logit_bias"),
        (b'{"prompt": "x", "n": 0}', "n"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"max_tokens": 3}', "prompt"),
        (b'{"prompt": "x", "top_p": 0}', "top_p"),
        (b'{"prompt": "x", "temperature": -1}', "temperature"),
        (b'{"prompt": "x", "stop": 3}', "stop"),
        (b'{"prompt": "x", "stop": [' + b",".join([b'"s"'] * 65) + b"]}", "stop"),
        (b'{"prompt": "x", "temperature": 1, "top_k": 1180591620717411303424}', "top_k"),
    ],
)
def test_wrong_types_and_values_are_400_naming_the_field(client, raw, field):
    assert_openai_error(post_raw(client, COMPLETIONS, raw), 400, field)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"max_tokens": 3}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": MSGS, "max_tokens": True}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
            "messages.0.content",
        ),
    ],
)
def test_bad_chat_bodies_are_400_naming_the_field(client, body, field):
    assert_openai_error(client.post(CHAT, json=body), 400, field)


def test_tiny_temperature_is_greedy_not_token_zero(client):
    greedy = client.post(COMPLETIONS, json={"prompt": [9, 8, 7], "max_tokens": 4, "temperature": 0}).json()
    tiny = client.post(COMPLETIONS, json={"prompt": [9, 8, 7], "max_tokens": 4, "temperature": 1e-40}).json()
    assert tiny["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
    assert greedy["choices"][0]["token_ids"] != [0, 0, 0, 0]


# -- what we do not implement is refused, never ignored ------------------------------------------------
@pytest.mark.parametrize(
    "path, extra, field",
    [
        (COMPLETIONS, {"best_of": 3}, "best_of"),
        (COMPLETIONS, {"suffix": "end"}, "suffix"),
        (COMPLETIONS, {"echo": True, "logprobs": 1}, "echo"),
        (COMPLETIONS, {"response_format": {"type": "json_object"}}, "response_format"),
        (COMPLETIONS, {"frobnicate": 1}, "frobnicate"),
        (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (CHAT, {"tool_choice": "auto"}, "tool_choice"),
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        (CHAT, {"functions": []}, "functions"),
    ],
)
def test_unsupported_fields_are_400_naming_them(client, path, extra, field):
    base = {"prompt": "x"} if path == COMPLETIONS else {"messages": MSGS}
    assert_openai_error(client.post(path, json={**base, "max_tokens": 2, **extra}), 400, field)


def test_chat_template_that_refuses_the_messages_is_400_naming_messages(client, engine):
    from server_support import CHAT_TEMPLATE

    strict = "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('start with a user turn') }}{% endif %}"
    engine.tokenizer.chat_template = strict + CHAT_TEMPLATE
    try:
        r = client.post(CHAT, json={"messages": [{"role": "assistant", "content": "x"}], "max_tokens": 1})
        err = assert_openai_error(r, 400, "messages")
        assert "start with a user turn" in err["message"]
        assert client.post(CHAT, json={"messages": MSGS, "max_tokens": 1}).status_code == 200
    finally:
        engine.tokenizer.chat_template = CHAT_TEMPLATE


def test_supported_no_op_values_are_accepted(client):
    ok = {"response_format": {"type": "text"}, "tool_choice": "none", "user": "u"}
    r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 2, **ok})
    assert r.status_code == 200, r.text
    r = client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "n": 2, "best_of": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


# -- size limits -------------------------------------------------------------------------------------
def test_oversized_body_is_413_before_the_tokenizer_sees_it(client, engine):
    calls = []
    original = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        r = client.post(COMPLETIONS, json={"prompt": "a" * 100_000, "max_tokens": 1})
        assert_openai_error(r, 413, "body")

        def chunked():  # no Content-Length: the cap is counted while reading
            for _ in range(100):
                yield b" " * 1000
            yield b'{"prompt": "x"}'

        r = client.post(COMPLETIONS, content=chunked(), headers={"content-type": "application/json"})
        assert_openai_error(r, 413, "body")
    finally:
        del engine.tokenizer.encode
    assert calls == []


def test_prompt_over_max_prompt_chars_is_400_without_tokenising():
    engine = make_engine(byte_tokenizer())
    seen = []
    original = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, *a, **k: seen.append(len(text)) or original(text, *a, **k)
    with live_server(engine, max_prompt_chars=1000) as url, httpx.Client(base_url=url, timeout=30) as c:
        assert_openai_error(c.post(COMPLETIONS, json={"prompt": "a" * 1001, "max_tokens": 1}), 400, "prompt")
        big_chat = {"messages": [{"role": "user", "content": "b" * 1001}], "max_tokens": 1}
        assert_openai_error(c.post(CHAT, json=big_chat), 400, "messages")
        assert (
            c.post(COMPLETIONS, json={"prompt": "a" * 1000, "max_tokens": 1}).status_code == 400
        )  # > context
    assert seen == [1000]


def test_default_prompt_cap_is_32_characters_per_context_token(engine):
    from kvbalance.server.async_engine import AsyncEngine

    assert AsyncEngine(engine).max_prompt_chars == 32 * 512


# -- logprobs of byte-level tokens ------------------------------------------------------------------
def test_logprobs_carry_each_tokens_true_bytes_and_every_alternative(client):
    r = client.post(
        CHAT,
        json={"messages": MSGS, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 20},
    ).json()
    for item in r["choices"][0]["logprobs"]["content"]:
        ids = [t["bytes"] for t in item["top_logprobs"]]
        assert all(len(b) == 1 for b in ids)  # token id = its byte value in this vocabulary
        assert len({b[0] for b in ids}) == 20
        assert item["bytes"] == ids[0]  # greedy: the chosen token is the most likely
    comp = client.post(COMPLETIONS, json={"prompt": [200, 201], "max_tokens": 3, "logprobs": 20}).json()
    tops = comp["choices"][0]["logprobs"]["top_logprobs"]
    assert all(len(top) == 20 for top in tops)  # no two alternatives share a key


def test_token_text_decodes_byte_level_pieces_exactly():
    from kvbalance.server.logprobs import TokenText

    text = TokenText(byte_tokenizer())
    euro = "€".encode()
    assert [text(b)[1] for b in euro] == [bytes([b]) for b in euro]
    assert text(0xE2)[0] == "\\xe2" and text(ord("a")) == ("a", b"a")
    assert TokenText(None)(7) == ("token_id:7", b"token_id:7")


# -- HTTP-level errors ---------------------------------------------------------------------------------
def test_method_not_allowed_and_unknown_path_are_client_errors(client):
    err = assert_openai_error(client.delete(COMPLETIONS), 405)
    assert err["type"] == "invalid_request_error"
    err = assert_openai_error(client.get("/v2/nothing"), 404)
    assert err["type"] == "not_found_error"


def test_unknown_model_is_404_naming_model(client):
    assert_openai_error(client.post(COMPLETIONS, json={"prompt": "x", "model": "gpt-7"}), 404, "model")


def test_prompt_longer_than_the_context_is_400_naming_prompt(client, engine):
    err = assert_openai_error(
        client.post(COMPLETIONS, json={"prompt": [1] * 600, "max_tokens": 4}), 400, "prompt"
    )
    assert "context" in err["message"]
    assert_openai_error(client.post(COMPLETIONS, json={"prompt": [300], "max_tokens": 4}), 400, "prompt")
    wait_until_idle(engine)


def test_full_queue_answers_429_with_retry_after_and_counts_it():
    engine = make_engine(step_delay_s=0.01)
    with live_server(engine, max_queue=1) as url, httpx.Client(base_url=url, timeout=30) as c:
        long_req = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.stream("POST", COMPLETIONS, json=long_req) as r:
            lines = r.iter_lines()  # kept open: dropping the iterator would close the stream
            assert next(line for line in lines if line.startswith("data: "))  # it is running
            busy = c.post(COMPLETIONS, json={"prompt": [1], "max_tokens": 2})
            err = assert_openai_error(busy, 429)
            assert err["type"] == "rate_limit_error" and busy.headers["retry-after"] == "1"
            with openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) as oai:
                with pytest.raises(openai.RateLimitError):
                    oai.completions.create(model="tiny-llama", prompt=[1], max_tokens=2)
        wait_until_idle(engine)
        assert c.post(COMPLETIONS, json={"prompt": [1], "max_tokens": 2}).status_code == 200
        m = metric_values(c)
    assert m['kvbalance_requests_total{finish_reason="overloaded"}'] == 2


def test_n_times_prompts_over_the_queue_is_400_naming_n(client):
    assert_openai_error(
        client.post(COMPLETIONS, json={"prompt": ["a"] * 8, "n": 9, "max_tokens": 1}), 400, "n"
    )


# -- API key and served model name ---------------------------------------------------------------------
def test_api_key_is_required_except_for_health():
    engine = make_engine()
    with live_server(engine, api_key="s3cret", model_name="my-model") as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            assert_openai_error(c.get("/v1/models"), 401)
            assert_openai_error(c.get("/metrics"), 401)
            r = c.post(COMPLETIONS, json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
            assert assert_openai_error(r, 401)["type"] == "authentication_error"
        with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0) as good:
            assert [m.id for m in good.models.list().data] == ["my-model"]
            r = good.completions.create(model="my-model", prompt="hi", max_tokens=2)
            assert r.model == "my-model" and len(r.choices[0].token_ids) == 2
            with pytest.raises(openai.NotFoundError):
                good.completions.create(model="tiny-llama", prompt="hi", max_tokens=2)


def test_cli_has_api_key_served_model_name_and_limits():
    import argparse

    from kvbalance.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "serve",
            "--api-key",
            "k",
            "--served-model-name",
            "m",
            "--max-body-bytes",
            "10",
            "--drain-timeout-s",
            "2",
        ]
    )
    assert (args.api_key, args.served_model_name, args.max_body_bytes, args.drain_timeout_s) == (
        "k",
        "m",
        10,
        2.0,
    )
    assert parser.parse_args(["serve"]).max_prompt_chars is None


def test_error_json_is_ascii_safe():
    from kvbalance.server.errors import SafeJSONResponse

    body = SafeJSONResponse({"error": {"message": "bad \ud800"}}).body
    assert json.loads(body)["error"]["message"] == "bad \ud800"
