"""Input budgets (issue 22): over-long input is refused before the expensive work, and heavy bodies in flight
do not hold up a small request behind them.

The stand-in is tiny-llama (a 512-token context) with a real byte-level BPE tokenizer (one token per UTF-8
byte, as slow per byte as GPT-2's); the character cap is raised, as a deployment may, so that the token
budget is what stands between a huge prompt and the tokenizer.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import pytest

pytest.importorskip("torch")  # the server and torch extras
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from server_support import CharTokenizer, byte_tokenizer, live_server, make_engine  # noqa: E402

from kvbalance.server.budget import PIECE_CHARS, tokens_over_budget, utf8_len  # noqa: E402
from kvbalance.server.protocol import MAX_CONTENT_PARTS, MAX_MESSAGES  # noqa: E402


class CountingEncode:
    """``encode`` that counts the characters it was given."""

    def __init__(self, tokens_per_char: int = 1) -> None:
        self.chars = 0
        self.calls = 0
        self.per_char = tokens_per_char

    def __call__(self, text: str) -> list[int]:
        self.chars += len(text)
        self.calls += 1
        return [0] * (len(text) * self.per_char)


def test_budget_stops_counting_soon_after_the_budget():
    enc = CountingEncode(tokens_per_char=3)  # emoji through a byte-level BPE: 3+ tokens a character
    counted = tokens_over_budget(enc, ["x" * 1_000_000], 8192)
    assert counted is not None and counted > 8192
    assert enc.chars <= 8192 // 3 + PIECE_CHARS  # one piece past the budget, never the whole text


def test_budget_never_refuses_text_that_fits_and_skips_short_text():
    enc = CountingEncode()
    assert tokens_over_budget(enc, ["a" * 100, "b" * 50], 200) is None and enc.calls == 0  # <= 200 bytes
    words = " ".join(["word"] * 5000)  # 24,999 characters, one token each here
    assert tokens_over_budget(CountingEncode(), [words], 24_999) is None
    assert tokens_over_budget(CountingEncode(), [words], 24_998 - 4 * 13) is not None
    # pieces end before a space where there is one near the cut
    seen = []
    tokens_over_budget(lambda t: seen.append(t) or [0], [words], 10)
    assert all(p.startswith(" ") for p in seen[1:]) and "".join(seen) == words


def test_budget_adds_the_messages_of_one_prompt():
    assert tokens_over_budget(CountingEncode(), ["a" * 600, "b" * 600], 1000) is not None
    assert tokens_over_budget(CountingEncode(), ["a" * 400, "b" * 400], 1000) is None


def test_utf8_len_counts_bytes():
    assert utf8_len("abc") == 3 and utf8_len("é") == 2 and utf8_len("\U0001f600") == 4


@pytest.fixture(scope="module")
def byte_server():
    engine = make_engine(byte_tokenizer())
    with live_server(engine, max_prompt_chars=4_000_000, max_body_bytes=16 << 20) as url:
        yield engine, url


def _chat(content: str, max_tokens: int = 4) -> bytes:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    return json.dumps(body, ensure_ascii=False).encode()


def _post(url: str, body: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=120)


def test_over_long_chat_is_refused_naming_the_field_after_a_bounded_count(byte_server):
    engine, url = byte_server
    t0 = time.perf_counter()
    r = _post(url, _chat("\U0001f600" * 500_000))  # 2 MB of UTF-8: 2M byte tokens
    took = time.perf_counter() - t0
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and "more than 512 tokens" in err["message"], err
    assert took < 10.0  # tokenising all of it takes seconds; counting stops after one piece
    r = _post(url, json.dumps({"prompt": "ab" * 300_000, "max_tokens": 1}).encode(), "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "more than 512 tokens" in r.json()["error"]["message"]


def test_a_prompt_that_fits_is_still_answered(byte_server):
    _, url = byte_server
    r = _post(url, _chat("x" * 400))  # 400 byte tokens + the template: within 512 with 4 to generate
    assert r.status_code == 200, r.text


def test_token_ids_over_the_context_are_refused_before_tokenising():
    engine = make_engine(CharTokenizer())
    with live_server(engine) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * 513, "max_tokens": 1}, timeout=30)
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith(
            "prompt: 513 token ids is more than the model's context"
        )
    assert engine.seen == {} and engine.tokenizer.encode_threads == []


def test_small_and_large_prompts_tokenise_on_separate_threads():
    engine = make_engine(CharTokenizer())
    with live_server(engine, max_prompt_chars=100_000) as url:
        for content in ("hi", "y" * 20_000):
            httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                       "max_tokens": 1}, timeout=30)  # fmt: skip
    assert engine.tokenizer.encode_threads[0].startswith("kvbalance-tokenizer_")
    assert engine.tokenizer.encode_threads[-1].startswith("kvbalance-tokenizer-bulk")


def test_message_and_content_part_counts_are_capped_while_parsing():
    engine = make_engine(CharTokenizer())
    with live_server(engine) as url, httpx.Client(base_url=url, timeout=30) as c:
        msgs = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
        r = c.post("/v1/chat/completions", json={"messages": msgs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert f"must have at most {MAX_MESSAGES} item(s)" in r.json()["error"]["message"]
        parts = [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    assert engine.tokenizer.encode_threads == []


def test_small_request_is_not_held_behind_heavy_bodies(byte_server):
    """Four 1 MB chat bodies in flight (each 1M byte tokens, refused for length) and a small chat behind them:
    its latency stays near its solo latency (the benchmark's bound is 2x; this one is generous)."""
    _, url = byte_server
    heavy = _chat("\U0001f600" * 250_000)
    small = _chat("hello", max_tokens=8)

    def small_s() -> float:
        t0 = time.perf_counter()
        assert _post(url, small).status_code == 200
        return time.perf_counter() - t0

    small_s()
    solo, behind, statuses = [], [], []
    for _ in range(3):
        solo.append(small_s())
        threads = [
            threading.Thread(target=lambda: statuses.append(_post(url, heavy).status_code)) for _ in range(4)
        ]
        for t in threads:
            t.start()
        time.sleep(0.05)
        behind.append(small_s())
        for t in threads:
            t.join()
    assert statuses == [400] * 12
    assert statistics.median(behind) < 3 * statistics.median(solo) + 1.0, (solo, behind)
