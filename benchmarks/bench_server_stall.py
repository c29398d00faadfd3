"""Head-of-line blocking in the server: a small request behind heavy bodies, and a stream while one tokenises.

``hol`` (the default; issue 22): serves SmolLM2-135M (its real tokenizer and chat template) from a process of
its own (as ``kvbalance serve`` would; this process is the clients), measures a small
greedy chat request alone, then posts ``--heavy`` chat bodies at once, each one message of ``--emoji``
emoji (about 3.1 MB of JSON escapes at the default: under the 4 MiB body cap and the 262,144-character cap,
but 786,000 tokens, far over the 8,192-token context), and sends the small request ``--delay-s`` after them.
Prints the small request's latency behind them over its solo latency (medians over ``--trials``) and how
long the heavy bodies took to be refused. Solo and behind alternate trial by trial, so the shared machine's
load falls on both.

``stream``: tiny-llama with a byte-level tokenizer streams a long completion while a text prompt of
``--prompt-mb`` MB arrives (limits raised so the server takes it); prints the stream's largest gap between
chunks with and without it.

    .venv/bin/python benchmarks/bench_server_stall.py                 # hol, 4 heavy bodies
    .venv/bin/python benchmarks/bench_server_stall.py stream --prompt-mb 0.2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import threading
import time
import warnings
from pathlib import Path

import httpx
import uvicorn


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tk = Tokenizer(models.BPE(vocab={c: b for b, c in bytes_to_unicode().items()}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(app) -> tuple[uvicorn.Server, str]:
    """Serve ``app`` from a thread of this process."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{port}"


def _serve_smollm2(port: int) -> None:  # the server process (a client of its own would share its GIL)
    warnings.filterwarnings("ignore")
    from kvbalance.llm import LLMEngine
    from kvbalance.server.app import create_app

    engine = LLMEngine("smollm2-135m", kv_cache_tokens=16_384, num_threads=1)
    uvicorn.run(create_app(engine, "smollm2-135m"), host="127.0.0.1", port=port, log_level="warning")


def spawn_smollm2_server() -> tuple[multiprocessing.Process, str]:
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=_serve_smollm2, args=(port,), daemon=True)
    proc.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("the server did not start")


SMALL = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}


def small_latency_s(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json={**SMALL, "temperature": 0}, timeout=600)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def behind_heavy(url: str, body: bytes, heavy: int, delay_s: float) -> tuple[float, list[tuple[int, float]]]:
    """The small request's latency sent ``delay_s`` after ``heavy`` bodies; each body's (status, seconds)."""
    out: list[tuple[int, float]] = []

    def post() -> None:
        t0 = time.perf_counter()
        r = httpx.post(
            f"{url}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=600,
        )
        out.append((r.status_code, time.perf_counter() - t0))

    threads = [threading.Thread(target=post) for _ in range(heavy)]
    for t in threads:
        t.start()
    time.sleep(delay_s)
    small = small_latency_s(url)
    for t in threads:
        t.join()
    return small, out


def hol(args) -> None:
    proc, url = spawn_smollm2_server()
    body = json.dumps({"messages": [{"role": "user", "content": "\U0001f600" * args.emoji}], "max_tokens": 8})
    body = body.encode()
    small_latency_s(url)  # warm-up
    solo, behind, refused = [], [], []
    for _ in range(args.trials):
        solo.append(small_latency_s(url))
        s, heavy = behind_heavy(url, body, args.heavy, args.delay_s)
        behind.append(s)
        refused.extend(heavy)
        solo.append(small_latency_s(url))
    proc.terminate()
    proc.join(10)
    statuses = sorted({st for st, _ in refused})
    row = {
        "heavy_bodies": args.heavy,
        "body_bytes": len(body),
        "emoji": args.emoji,
        "trials": args.trials,
        "solo_s_median": round(statistics.median(solo), 3),
        "behind_s_median": round(statistics.median(behind), 3),
        "ratio": round(statistics.median(behind) / statistics.median(solo), 2),
        "behind_s": [round(x, 3) for x in behind],
        "solo_s": [round(x, 3) for x in solo],
        "heavy_statuses": statuses,
        "heavy_refused_s_median": round(statistics.median(t for _, t in refused), 2),
        "heavy_refused_s_max": round(max(t for _, t in refused), 2),
    }
    print(
        f"{args.heavy} chat bodies of {len(body):,} bytes ({args.emoji:,} emoji) in flight, answered {statuses}"
    )
    print(f"small request: {row['solo_s_median']:.3f} s alone, {row['behind_s_median']:.3f} s behind them "
          f"({row['ratio']:.2f}x; medians of {args.trials} trials)")  # fmt: skip
    print(
        f"heavy bodies refused after {row['heavy_refused_s_median']:.2f} s (median), {row['heavy_refused_s_max']:.2f} s (max)"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(row, indent=2) + "\n")


def stream_gaps(url: str, max_tokens: int, during=None) -> tuple[float, float | None]:
    """Largest gap between chunks of one stream; ``during()`` runs in a thread after the 5th chunk."""
    times, side = [], {}
    body = {"prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=600) as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.perf_counter())
                if len(times) == 5 and during is not None:
                    t = threading.Thread(target=lambda: side.setdefault("s", during()))
                    t.start()
    if during is not None:
        t.join()
    gaps = [b - a for a, b in zip(times[5:], times[6:])]
    return max(gaps), side.get("s")


def stream(args) -> None:
    from kvbalance.llm import LLMEngine
    from kvbalance.server.app import create_app

    engine = LLMEngine("tiny-llama", kv_cache_tokens=4096, max_num_batched_tokens=256, num_threads=1)
    engine.tokenizer, engine.eos_token_id = byte_tokenizer(), None
    size = int(args.prompt_mb * 1e6)
    app = create_app(engine, "tiny-llama", max_body_bytes=2 * size + 4096, max_prompt_chars=2 * size)
    server, url = start_server(app)

    def big() -> float:
        t0 = time.perf_counter()
        with httpx.Client(base_url=url, timeout=600) as c:
            r = c.post("/v1/completions", json={"prompt": "a" * size, "max_tokens": 1})
        assert r.status_code == 400, r.text  # longer than the context
        return time.perf_counter() - t0

    quiet, _ = stream_gaps(url, args.max_tokens)
    loaded, big_s = stream_gaps(url, args.max_tokens, big)
    print(f"prompt: {size:,} characters; its 400 came after {big_s:.2f} s")
    print(
        f"running stream, largest gap between chunks: {quiet * 1e3:.1f} ms alone, {loaded * 1e3:.1f} ms meanwhile"
    )
    server.should_exit = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", nargs="?", default="hol", choices=("hol", "stream"))
    ap.add_argument("--heavy", type=int, default=4, help="hol: heavy bodies in flight")
    ap.add_argument("--emoji", type=int, default=262_000, help="hol: emoji per heavy body")
    ap.add_argument("--delay-s", type=float, default=0.3, help="hol: the small request follows after this")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default=None, help="hol: write the figures as JSON here")
    ap.add_argument("--prompt-mb", type=float, default=0.2, help="stream: the big prompt's size")
    ap.add_argument("--max-tokens", type=int, default=500, help="stream: the running stream's length")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    hol(args) if args.scenario == "hol" else stream(args)


if __name__ == "__main__":
    main()
