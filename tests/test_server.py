"""The OpenAI-compatible server, live on loopback over the tiny random model: the happy paths.

Requests go through the ``openai`` client where it can express them (and httpx for the wire details);
outputs of batched requests are compared token for token with the same requests run alone.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from server_support import (  # noqa: E402
    CharTokenizer,
    live_server,
    make_engine,
    metric_values,
    sse_events,
    wait_until_idle,
)

pytestmark = pytest.mark.filterwarnings("ignore::Warning")


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


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


# -- plain endpoints -----------------------------------------------------------------------------
def test_openapi_schema_describes_both_generation_endpoints(client):
    schema = client.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "n", "logit_bias", "echo", "presence_penalty"} <= set(fields)


def test_health_and_models(client, oai):
    assert client.get("/health").json()["status"] == "ok"
    cards = oai.models.list().data
    assert [c.id for c in cards] == ["tiny-llama"]
    card = client.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == 512 and card["vocab_size"] == 256


def test_completion_with_token_ids_returns_tokens_and_usage(oai, engine):
    r = oai.completions.create(
        model="tiny-llama",
        prompt=list(range(1, 21)),
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    assert r.object == "text_completion"
    assert len(choice.token_ids) == 7 and choice.finish_reason == "length"
    assert len(choice.text) == 7  # one character per token with the fake tokenizer
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (20, 7, 27)
    wait_until_idle(engine)


def test_completion_logprobs_are_log_probabilities_of_the_chosen_tokens(oai):
    r = oai.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=3, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    assert all(len(top) == 2 for top in lp.top_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and chosen == pytest.approx(max(top.values()))  # greedy: the most likely one


def test_seeded_text_completion_is_reproducible_and_stop_string_cuts_it(oai):
    # a hot temperature, so the random model's text varies from token to token
    req = dict(model="tiny-llama", prompt="The quick brown fox", max_tokens=24, temperature=20.0, seed=7)
    extra = {"ignore_eos": True}
    first = oai.completions.create(**req, extra_body=extra).choices[0].text
    again = oai.completions.create(**req, extra_body=extra).choices[0].text
    assert first == again and len(first) == 24
    stop = first[10]
    cut = first.find(stop)
    r = oai.completions.create(**req, stop=[stop], extra_body=extra).choices[0]
    assert r.text == first[:cut]
    assert r.finish_reason == "stop"


def test_streaming_completion_matches_the_non_streaming_text(client, oai):
    req = dict(
        model="tiny-llama", prompt="hello", max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = oai.completions.create(**req).choices[0].text
    chunks = list(oai.completions.create(**req, stream=True, stream_options={"include_usage": True}))
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == whole
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == 5
    body = {"prompt": "hello", "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 9


def test_chat_completion_and_chat_stream(oai):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=5, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and len(msg.content) == 5
    prompt_len = len(CharTokenizer().apply_chat_template(msgs))
    assert r.usage.prompt_tokens == prompt_len and r.usage.completion_tokens == 5

    chunks = list(
        oai.chat.completions.create(
            model="tiny-llama", messages=msgs, max_tokens=5, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


# -- batching -------------------------------------------------------------------------------------
def _prompts() -> list[list[int]]:
    return [[(7 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(5)]


def test_batched_outputs_equal_solo_outputs(base_url, oai, engine):
    wait_until_idle(engine)
    solo = [
        oai.completions.create(
            model="tiny-llama", prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .token_ids
        for p in _prompts()
    ]

    async def together():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
            calls = [
                c.completions.create(
                    model="tiny-llama",
                    prompt=p,
                    max_tokens=12,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for p in _prompts()
            ]
            return await asyncio.gather(*calls)

    before = len(engine.step_log)
    batched = [r.choices[0].token_ids for r in asyncio.run(together())]
    assert max(seqs for _, seqs, _, _ in engine.step_log[before:]) > 1  # they did share steps
    assert batched == solo
    wait_until_idle(engine)


def test_one_request_with_a_list_of_prompts_equals_the_prompts_one_by_one(oai):
    prompts = _prompts()[:3]
    one_by_one = [
        oai.completions.create(model="tiny-llama", prompt=p, max_tokens=6, temperature=0).choices[0].token_ids
        for p in prompts
    ]
    r = oai.completions.create(model="tiny-llama", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.token_ids for c in r.choices] == one_by_one
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts) and r.usage.completion_tokens == 18


# -- metrics ----------------------------------------------------------------------------------------
def test_metrics_count_exactly_what_one_request_did():
    engine = make_engine()
    with live_server(engine) as url, httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/metrics").headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        before = metric_values(c)
        assert before["kvbalance_kv_capacity_tokens"] == 4096
        assert before["kvbalance_generation_tokens_total"] == 0
        r = c.post(
            "/v1/completions", json={"prompt": list(range(1, 21)), "max_tokens": 7, "ignore_eos": True}
        )
        assert r.status_code == 200
        wait_until_idle(engine)
        m = metric_values(c)
    assert m['kvbalance_requests_total{finish_reason="length"}'] == 1
    assert m["kvbalance_prompt_tokens_total"] == 20
    assert m["kvbalance_generation_tokens_total"] == 7
    assert m["kvbalance_engine_steps_total"] == 7  # one prefill step (20 < 256-token budget) + 6 decodes
    assert m["kvbalance_time_to_first_token_seconds_count"] == 1
    assert m["kvbalance_e2e_request_latency_seconds_count"] == 1
    assert m["kvbalance_time_per_output_token_seconds_count"] == 1
    assert m['kvbalance_time_to_first_token_seconds_bucket{le="+Inf"}'] == 1
    assert (
        0 < m["kvbalance_time_to_first_token_seconds_sum"] <= m["kvbalance_e2e_request_latency_seconds_sum"]
    )
    assert m["kvbalance_num_requests_running"] == 0 and m["kvbalance_num_requests_waiting"] == 0
    assert m["kvbalance_kv_used_tokens"] == 0 and m["kvbalance_kv_usage_ratio"] == 0
    assert m["kvbalance_preemptions_total"] == 0
    assert m["kvbalance_kv_free_blocks"] == 4096 // 64  # 27 tokens never filled a 64-token block to cache


def test_metrics_prefix_hits_count_the_cached_block():
    engine = make_engine()  # 64-token blocks on CPU: a 70-token prompt caches one full block
    prompt = [(3 * i) % 200 + 1 for i in range(70)]
    with live_server(engine) as url, httpx.Client(base_url=url, timeout=30) as c:
        for _ in range(2):
            assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
        wait_until_idle(engine)
        m = metric_values(c)
    assert m["kvbalance_prefix_hit_tokens_total"] == 64
    assert m["kvbalance_prefix_cache_hit_rate"] == pytest.approx(64 / 140)
    assert m["kvbalance_kv_free_blocks"] == 4096 // 64 - 1  # the cached block is idle, not free
