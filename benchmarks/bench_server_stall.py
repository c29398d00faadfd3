"""How long a running stream stalls while the server tokenises a huge prompt (prints figures).

Serves tiny-llama with a real byte-level BPE tokenizer (HF ``tokenizers``; 256 byte tokens, so one token
per byte), streams a long greedy completion, and halfway through posts a text prompt of ``--prompt-mb``
MB (limits raised so the server takes it, and the context check rejects it after tokenising). Prints the
running stream's largest gap between chunks with and without the big prompt, and how long the big
request took to be answered. Tokenising off the engine thread keeps the gap near one step.

    .venv/bin/python benchmarks/bench_server_stall.py --prompt-mb 0.2
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
import warnings

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-mb", type=float, default=0.2)
    ap.add_argument("--max-tokens", type=int, default=500)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from kvbalance.llm import LLMEngine
    from kvbalance.server.app import create_app

    engine = LLMEngine("tiny-llama", kv_cache_tokens=4096, max_num_batched_tokens=256, num_threads=1)
    engine.tokenizer, engine.eos_token_id = byte_tokenizer(), None
    size = int(args.prompt_mb * 1e6)
    app = create_app(engine, "tiny-llama", max_body_bytes=2 * size + 4096, max_prompt_chars=2 * size)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"

    def big() -> float:
        t0 = time.perf_counter()
        with httpx.Client(base_url=url, timeout=600) as c:
            r = c.post("/v1/completions", json={"prompt": "a" * size, "max_tokens": 1})
        assert r.status_code == 400, r.text  # longer than the context, found after tokenising
        return time.perf_counter() - t0

    quiet, _ = stream_gaps(url, args.max_tokens)
    loaded, big_s = stream_gaps(url, args.max_tokens, big)
    print(f"prompt: {size:,} characters; its 400 came after {big_s:.2f} s")
    print(
        f"running stream, largest gap between chunks: {quiet * 1e3:.1f} ms alone, {loaded * 1e3:.1f} ms meanwhile"
    )
    server.should_exit = True


if __name__ == "__main__":
    main()
