"""Helpers for the server tests: the tiny random model with stand-in tokenizers, a live loopback server.

``CharTokenizer`` maps one character to one id (printable ASCII back); ``byte_tokenizer()`` is a real
byte-level BPE (``tokenizers``) whose 256 tokens are the 256 bytes, so ``é`` is two tokens that decode to
U+FFFD alone, as in GPT-2-style vocabularies. ``TestEngine`` can slow every step (so a request outlasts any
wait in a test) and keeps every ``Request`` it was given, to check what became of it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

from kvbalance.llm import LLMEngine
from kvbalance.request import RequestState
from kvbalance.server.app import create_app
from kvbalance.server.serving import make_server

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class CharTokenizer:
    """Tokenizer stand-in for a 256-token vocab: one id per character, printable ASCII on the way back."""

    eos_token_id = None
    chat_template = "<role>content..."

    def __init__(self) -> None:
        self.encode_threads: list[str] = []  # the thread each encode ran on

    def encode(self, text: str) -> list[int]:
        self.encode_threads.append(threading.current_thread().name)
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x20 + int(i) % 95) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def byte_tokenizer():
    """A byte-level BPE tokenizer with exactly the 256 byte tokens (token id = byte value)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: b for b, c in bytes_to_unicode().items()}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    tok.chat_template = CHAT_TEMPLATE
    return tok


class TestEngine(LLMEngine):
    """LLMEngine over tiny-llama that can sleep ``step_delay_s`` per step and remembers its requests."""

    __test__ = False

    def __init__(self, step_delay_s: float = 0.0, **kwargs) -> None:
        kwargs = {"kv_cache_tokens": 4096, "max_num_batched_tokens": 256, "num_threads": 1, **kwargs}
        super().__init__(model="tiny-llama", **kwargs)
        self.step_delay_s = step_delay_s
        self.seen: dict = {}

    def add_request(self, prompt, params=None, request_id=None):
        req = super().add_request(prompt, params, request_id)
        self.seen[req.request_id] = req
        return req

    def step(self):
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return super().step()


def make_engine(tokenizer=None, step_delay_s: float = 0.0, **kwargs) -> TestEngine:
    engine = TestEngine(step_delay_s, **kwargs)
    engine.tokenizer = tokenizer if tokenizer is not None else CharTokenizer()
    engine.eos_token_id = None
    return engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A running server: ``url``, the uvicorn ``server`` and ``stop()`` (a graceful shutdown)."""

    def __init__(self, server, thread, url: str) -> None:
        self.server, self.thread, self.url = server, thread, url

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


@contextlib.contextmanager
def live(engine, max_queue: int = 64, drain_timeout_s: float = 5.0, **app_kwargs):
    """Run the app with uvicorn in a thread on a free loopback port; yield a ``LiveServer``."""
    app = create_app(engine, app_kwargs.pop("model_name", "tiny-llama"), max_queue=max_queue, **app_kwargs)
    server = make_server(
        app, "127.0.0.1", _free_port(), drain_timeout_s=drain_timeout_s, log_level="warning", lifespan="on"
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    live_server = LiveServer(server, thread, f"http://127.0.0.1:{server.config.port}")
    try:
        yield live_server
    finally:
        live_server.stop()


@contextlib.contextmanager
def live_server(engine, max_queue: int = 64, **app_kwargs):
    """Like ``live``, yielding only the base URL."""
    with live(engine, max_queue, **app_kwargs) as s:
        yield s.url


def kv_blocks_held(engine) -> int:
    """Blocks held by requests: KV tokens of running requests, in blocks."""
    load = engine.instance.load()
    return load.kv_used_tokens // engine.executor.block_size


def wait_until_idle(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = engine.instance.load()
        if load.num_running == 0 and load.num_waiting == 0 and load.kv_used_tokens == 0:
            return
        time.sleep(0.02)
    load = engine.instance.load()
    raise AssertionError(f"engine still busy: {load}")


def wait_for_state(req, states=(RequestState.ABORTED,), timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while req.state not in states and time.monotonic() < deadline:
        time.sleep(0.01)
    assert req.state in states, f"{req!r} is {req.state}, expected one of {states}"


def sse_events(response) -> list:
    """Parse ``data: ...`` lines of an SSE response (or of its ``iter_lines()`` already begun); ``[DONE]`` kept."""
    events = []
    for line in response.iter_lines() if hasattr(response, "iter_lines") else response:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric_values(client) -> dict[str, float]:
    from kvbalance.server.metrics import parse_prometheus_text

    return parse_prometheus_text(client.get("/metrics").text)
