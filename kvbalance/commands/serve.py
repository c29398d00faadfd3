"""``kvbalance serve``: the OpenAI-compatible HTTP server over the real engine (extras: server, torch)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server over the real engine (extra: server, torch)"
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--kv-tokens", type=int, default=65_536)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)


def run(args) -> int:
    from kvbalance.server.app import serve

    serve(
        args.model,
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        kv_cache_tokens=args.kv_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.chunk_size,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.threads,
    )
    return 0
