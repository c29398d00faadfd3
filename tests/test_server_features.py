"""What users expect of a completion server: n > 1, logit_bias, presence/frequency penalties, echo.

The sampling math is checked exactly on logits (OpenAI's formula); the server paths end to end through
the ``openai`` client, against the same requests made without the feature.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvbalance.model.sampling import SampleRequest, apply_logit_adjustments, sample  # noqa: E402
from kvbalance.request import SamplingParams  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")


# -- sampling math --------------------------------------------------------------------------------
def test_penalties_and_bias_follow_openais_formula():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5]])
    params = [
        SampleRequest(
            logit_bias={0: 10.0, 3: -1.5},
            presence_penalty=0.5,
            frequency_penalty=0.25,
            output_token_ids=[2, 2, 2, 1],
        ),
        SampleRequest(),
    ]
    out = apply_logit_adjustments(logits, params)
    # mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j]; c = [0, 1, 3, 0]
    expected = [1.0 + 10.0, 2.0 - 0.25 - 0.5, 3.0 - 0.75 - 0.5, 4.0 - 1.5]
    assert out[0].tolist() == pytest.approx(expected)
    assert out[1].tolist() == logits[1].tolist()
    assert logits[0].tolist() == [1.0, 2.0, 3.0, 4.0]  # the raw logits are left alone
    assert apply_logit_adjustments(logits, [SampleRequest(), SampleRequest()]) is logits


def test_logit_bias_steers_greedy_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    tokens, lps = sample(logits, [SampleRequest(logit_bias={2: 100.0}, logprobs=1)])
    assert tokens == [2]
    raw = logits.log_softmax(-1)[0]
    assert lps[0].logprob == pytest.approx(raw[2].item()) and lps[0].top_ids == [1]


def test_temperature_below_eps_is_greedy_and_never_nan():
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9]])
    tokens, _ = sample(
        logits.repeat(2, 1), [SampleRequest(temperature=1e-40), SampleRequest(temperature=1e-6)]
    )
    assert tokens == [1, 1]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: float("inf")}}, "logit_bias"),
    ],
)
def test_sampling_params_reject_bad_adjustments(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


# -- end to end ----------------------------------------------------------------------------------
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from server_support import live_server, make_engine, sse_events, wait_until_idle  # noqa: E402

PROMPT = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def engine():
    return make_engine()


@pytest.fixture(scope="module")
def base_url(engine):
    with live_server(engine) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _ids(r) -> list[list[int]]:
    return [c.token_ids for c in r.choices]


def test_n_greedy_choices_are_identical_and_indexed(oai):
    solo = oai.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=0)
    r = oai.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert _ids(r) == _ids(solo) * 3
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 15


def test_n_seeded_choices_are_seed_plus_index(oai):
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=20.0)
    r = oai.completions.create(**kw, n=3, seed=100)
    singles = [oai.completions.create(**kw, seed=100 + j).choices[0].token_ids for j in range(3)]
    assert _ids(r) == singles
    assert len({tuple(t) for t in singles}) == 3  # hot and differently seeded: the choices differ


def test_n_chat_streams_every_choice(base_url, engine):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "n": 2}
    with httpx.Client(base_url=base_url, timeout=30) as c:
        whole = c.post("/v1/chat/completions", json=body).json()
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    text = {0: "", 1: ""}
    for e in events[:-1]:
        for ch in e["choices"]:
            text[ch["index"]] += ch["delta"].get("content", "")
    assert [text[0], text[1]] == [ch["message"]["content"] for ch in whole["choices"]]
    assert whole["usage"]["completion_tokens"] == 8
    wait_until_idle(engine)


def test_logit_bias_forces_a_token(oai):
    r = oai.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={"77": 100}
    )
    assert _ids(r) == [[77] * 4]
    base = oai.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0)
    banned = base.choices[0].token_ids[0]
    r = oai.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(banned): -100}
    )
    assert banned not in r.choices[0].token_ids


def test_penalties_stop_greedy_repetition(oai):
    kw = dict(model="tiny-llama", prompt=[5] * 8, max_tokens=24, temperature=0)
    plain = oai.completions.create(**kw).choices[0].token_ids
    assert len(set(plain)) < len(plain)  # the random model repeats itself
    fresh = oai.completions.create(**kw, presence_penalty=2.0, frequency_penalty=2.0).choices[0].token_ids
    assert len(set(fresh)) > len(set(plain))
    assert fresh[0] == plain[0]  # nothing to penalise before the first token


def test_echo_prepends_the_prompt(oai, base_url):
    plain = oai.completions.create(model="tiny-llama", prompt="abc", max_tokens=3, temperature=0).choices[0]
    echoed = oai.completions.create(model="tiny-llama", prompt="abc", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == "abc" + plain.text
    chunks = list(
        oai.completions.create(
            model="tiny-llama", prompt="abc", max_tokens=3, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "abc" + plain.text
