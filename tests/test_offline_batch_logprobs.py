"""Batch API logprobs are the server's: each byte-level token carries its true bytes (not U+FFFD's) and every
``top_logprobs`` alternative is kept, equal, field for field, to what the server answers for the request.

The tokenizer is ``server_support.byte_tokenizer()``: a real byte-level BPE whose 256 tokens are the 256
bytes, so a token >= 0x80 is part of a UTF-8 character and decodes to U+FFFD on its own.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")  # the server extra: the Batch answers are compared with the live server's
pytest.importorskip("prometheus_client")

from server_support import byte_tokenizer, live_server, make_engine  # noqa: E402

from kvbalance.offline.batch_worker import LocalBackend  # noqa: E402
from kvbalance.offline.runner import run_batch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")

REPLACEMENT = list("\ufffd".encode())  # what decoding a lone continuation byte gives, as bytes
CHAT_BODY = {
    "messages": [{"role": "user", "content": "h\u00e9 \u20ac"}],
    "max_tokens": 4,
    "temperature": 0,
    "logprobs": True,
    "top_logprobs": 20,
}
COMPLETION_BODY = {"prompt": [200, 201, 0xE2, 0x82], "max_tokens": 4, "temperature": 0, "logprobs": 20}


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """custom id -> (the Batch output line's response body, the server's response), one engine each."""
    d = tmp_path_factory.mktemp("batch")
    backend = LocalBackend(make_engine(byte_tokenizer()), "tiny-llama")
    batch = {}
    # one job per request, as the server runs them one after another: the same steps, so the same floats
    for cid, url, body in [
        ("chat", "/v1/chat/completions", CHAT_BODY),
        ("cmpl", "/v1/completions", COMPLETION_BODY),
    ]:
        job, out = d / f"{cid}.jsonl", d / f"{cid}.out.jsonl"
        job.write_text(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n")
        run_batch(job, out, backend, progress=False)
        (line,) = out.read_text().splitlines()
        batch[cid] = json.loads(line)["response"]["body"]
    with live_server(make_engine(byte_tokenizer())) as url, httpx.Client(base_url=url, timeout=60) as c:
        served = {
            "chat": c.post("/v1/chat/completions", json=CHAT_BODY).json(),
            "cmpl": c.post("/v1/completions", json=COMPLETION_BODY).json(),
        }
    return {k: (batch[k], served[k]) for k in ("chat", "cmpl")}


def test_batch_chat_logprobs_carry_true_bytes_and_every_alternative(answers):
    body, _ = answers["chat"]
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    high = 0
    for item in content:
        alts = [t["bytes"] for t in item["top_logprobs"]]
        assert all(len(b) == 1 for b in alts)  # one byte per token in this vocabulary, never U+FFFD's three
        assert len({b[0] for b in alts}) == 20  # every alternative, no two alike
        assert item["bytes"] == alts[0]  # greedy: the chosen token is the most likely
        for t in (item, *item["top_logprobs"]):
            if t["bytes"][0] >= 0x80:  # a partial UTF-8 character: shown as \xNN, its own byte kept
                high += 1
                assert t["token"] == f"\\x{t['bytes'][0]:02x}" and t["bytes"] != REPLACEMENT
    assert high > 0  # the test saw byte-level tokens


def test_batch_completion_top_logprobs_keep_every_alternative(answers):
    body, _ = answers["cmpl"]
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4
    assert all(len(top) == 20 for top in lp["top_logprobs"])  # no two alternatives share a key
    assert any(k.startswith("\\x") for top in lp["top_logprobs"] for k in top)


@pytest.mark.parametrize("cid", ["chat", "cmpl"])
def test_batch_logprobs_equal_the_servers(answers, cid):
    body, served = answers[cid]
    got, want = body["choices"][0], served["choices"][0]
    assert got["token_ids"] == want["token_ids"]
    assert got["logprobs"] == want["logprobs"]
