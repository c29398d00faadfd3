"""The real cluster on this machine's cores, measured with ``kvbalance bench``, the simulator's prediction beside it.

Set-ups (one core each, SmolLM2-135M, every instance an actor of ``kvbalance serve --cluster``):
``colocated1`` (1 colocated instance, core 0), ``colocated2`` (2 colocated, cores 0 and 1, router
``least_loaded``), ``pd`` (1 prefill on core 0 + 1 decode on core 1, the KV through Ray's object store).
Each set-up is launched (``raycluster.launch``), served by the front end on loopback (uvicorn in this
process) and driven by ``kvbalance.bench.run_bench`` (the same requests ``kvbalance simulate`` builds from
the workload, seed and count, all at once by default); then the same requests run through the cluster
simulator (``cluster.config.run_cluster``) on a CPU preset fitted here by ``kvbalance profile`` (``--preset``
reuses one), with the same instances, scheduler knobs and KV capacity. Set-ups alternate order over
``--repeats``. Writes ``results.json`` and ``README.md`` (a table: measured | simulated per figure) to ``--out``.

    nice -n 10 .venv/bin/python benchmarks/bench_cluster_real.py --num-requests 48 --out benchmarks/results/cluster_real
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

SETUPS = {
    "colocated1": {"instances": [{"role": "colocated", "cpu_cores": ["0"]}]},
    "colocated2": {"instances": [{"role": "colocated", "count": 2, "cpu_cores": ["0", "1"]}]},
    "pd": {"instances": [{"role": "prefill", "cpu_cores": ["0"]}, {"role": "decode", "cpu_cores": ["1"]}]},
}
FIGURES = ("output_tokens_per_s", "output_tokens_per_cpu_s", "ttft_mean_s", "ttft_p50_s", "tpot_mean_s",
           "tpot_p50_s", "makespan_s")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick(summary: dict) -> dict:
    """The figures compared, from a ``metrics.summary.summarize`` dict (bench and simulation alike)."""
    ttft, tpot = summary.get("ttft_s") or {}, summary.get("tpot_s") or {}
    return {
        "output_tokens_per_s": summary.get("output_tokens_per_s"),
        "ttft_mean_s": ttft.get("mean"),
        "ttft_p50_s": ttft.get("p50"),
        "tpot_mean_s": tpot.get("mean"),
        "tpot_p50_s": tpot.get("p50"),
        "makespan_s": summary.get("makespan_s"),
    }


def measure(name: str, engine: dict, args) -> dict:
    from kvbalance.bench import run_bench
    from kvbalance.raycluster.config import parse_cluster_file
    from kvbalance.raycluster.launch import create_cluster_app, launch
    from kvbalance.server.serving import make_server

    section = {**SETUPS[name], "router": args.router}
    eng, cfg = parse_cluster_file({**engine, "cluster": section})
    t0 = time.perf_counter()
    cluster = launch(eng, cfg)
    started_s = time.perf_counter() - t0
    app, aengine = create_cluster_app(cluster, model_name=eng.model, max_queue=4 * args.num_requests)
    port = free_port()
    server = make_server(app, "127.0.0.1", port, drain_timeout_s=5.0, log_level="warning", lifespan="on")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    import ray

    actors = [sl.actor for sl in cluster.backend.slots]
    try:
        load_before = os.getloadavg()[0]
        cpu_before = ray.get([a.cpu_s.remote() for a in actors])
        summary = run_bench(
            f"http://127.0.0.1:{port}",
            num_requests=args.num_requests,
            rate=args.rate,
            workload=args.workload,
            seed=args.seed,
            model=eng.model,
            max_context=args.max_context,
            show_progress=False,
        )
        cpu = [b - a for a, b in zip(cpu_before, ray.get([a.cpu_s.remote() for a in actors]))]
        load_after = os.getloadavg()[0]
        rows = cluster.backend.instance_rows()
        counters = dict(cluster.backend.counters)
    finally:
        server.should_exit = True
        thread.join(30)
        aengine.shutdown()
        cluster.close()
    figures = pick(summary)
    # the instances run side by side, one core each: uncontended, the run would take the busiest one's CPU time
    out_tokens = figures["output_tokens_per_s"] * figures["makespan_s"]
    figures["output_tokens_per_cpu_s"] = out_tokens / max(cpu)
    return {
        "figures": figures,
        "completed": summary.get("completed"),
        "startup_s": started_s,
        "instance_cpu_s": cpu,
        "load_avg_before": load_before,
        "load_avg_after": load_after,
        "instances": [
            {"instance": r["instance"], "routed": r["routed"], "steps": r["load"].num_steps} for r in rows
        ],
        "counters": counters,
        "summary": summary,
    }


def predict(name: str, engine: dict, preset: str, args) -> dict:
    from kvbalance.cluster.config import ClusterConfig, run_cluster
    from kvbalance.sim.run import SimulateConfig, config_requests

    sim = SimulateConfig(
        model=engine["model"],
        gpu=preset,
        workload=args.workload,
        rate=args.rate,
        num_requests=args.num_requests,
        chunk_size=engine["chunk_size"],
        max_num_seqs=engine["max_num_seqs"],
        block_size=engine["block_size"],
        kv_tokens=engine["kv_tokens"],
        max_context=args.max_context,
        seed=args.seed,
    )
    groups = [{k: v for k, v in g.items() if k != "cpu_cores"} for g in SETUPS[name]["instances"]]
    ccfg = ClusterConfig(instances=groups, router=args.router)
    res = run_cluster(sim, ccfg, config_requests(sim, args.max_context))
    figures = pick(res.summary)
    figures["output_tokens_per_cpu_s"] = figures["output_tokens_per_s"]  # the preset is fitted on CPU time
    return {"figures": figures, "completed": res.summary.get("completed"), "summary": res.summary}


class _Peer:
    """A bare actor for the round-trip probe: echoes what it is sent, or calls another peer ``n`` times."""

    def echo(self, x):
        return x

    def ping_pong(self, other, payload_bytes: int, n: int) -> list[float]:
        import numpy as np
        import ray

        x = np.zeros(payload_bytes // 2, dtype=np.int16)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            ray.get(other.echo.remote(x))
            times.append(time.perf_counter() - t)
        return times


def probe_round_trips(hidden_size: int, batches=(1, 64), n: int = 50) -> dict:
    """Median actor-to-actor round trip carrying a step's hidden states (bf16), what a layer split pays
    once per step and an attention split once per layer per step across processes."""
    import ray

    peer = ray.remote(num_cpus=0)(_Peer)
    a, b = peer.remote(), peer.remote()
    out = {}
    for batch in batches:
        nbytes = batch * hidden_size * 2
        times = sorted(ray.get(a.ping_pong.remote(b, nbytes, n)))
        out[f"batch{batch}_{nbytes}B_ms"] = 1e3 * times[len(times) // 2]
    for h in (a, b):
        ray.kill(h)
    return out


def fit_preset(model: str, out: Path) -> str:
    from kvbalance.profile import ProfileConfig, run_profile

    # fitted on the profiling process's CPU time: on a shared machine that approximates uncontended steps
    cfg = ProfileConfig(model=model, threads=1, validate=False, clock="cpu")
    run_profile(cfg, out / "profile")
    return str(out / "profile" / "hardware.json")


def fmt(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def write_readme(out: Path, results: dict, args) -> None:
    lines = [
        "# Real cluster on Ray vs the simulator's prediction",
        "",
        f"`{results['command']}`",
        "",
        f"SmolLM2-135M ({args.dtype}), {args.num_requests} `{args.workload}` requests at rate {args.rate} (seed {args.seed}, "
        f"max context {args.max_context}), router `{args.router}`, one core per instance; preset "
        f"`{results['preset']}`. Each cell: measured / simulated (ratio measured over simulated).",
        "",
        "`output_tokens_per_cpu_s`: output tokens over the busiest instance's CPU seconds (what the run would",
        "take uncontended, one core each; the preset is fitted on CPU time too). Load: the machine's 1-minute",
        "load average before / after the run (2 cores, shared).",
        "",
        "| set-up | run | load | " + " | ".join(FIGURES) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in FIGURES) + " |",
    ]
    for name, runs in results["setups"].items():
        for k, r in enumerate(runs):
            cells = []
            for f in FIGURES:
                m, s = r["measured"]["figures"][f], r["simulated"]["figures"][f]
                ratio = f" ({m / s:.2f}x)" if m and s else ""
                cells.append(f"{fmt(m)} / {fmt(s)}{ratio}")
            load = f"{r['measured']['load_avg_before']:.1f} / {r['measured']['load_avg_after']:.1f}"
            lines.append(f"| {name} | {k + 1} | {load} | " + " | ".join(cells) + " |")
    probe = results.get("round_trip_probe")
    if probe:
        lines += ["", "Actor-to-actor round trip with one step's hidden states (median ms): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in probe.items())]  # fmt: skip
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", default="colocated1,colocated2,pd")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=math.inf)
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-context", type=int, default=768)
    p.add_argument("--router", default="least_loaded")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-tokens", type=int, default=32_768)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument(
        "--dtype", default="float32", help="the instances' (float32: what `kvbalance profile` fits)"
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--preset", default=None, help="a CPU preset from `kvbalance profile` (default: fit one now)"
    )
    p.add_argument("--out", default="benchmarks/results/cluster_real")
    p.add_argument("--no-probe", action="store_true", help="skip the actor round-trip probe")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [s for s in args.setups.split(",") if s]
    for s in names:
        if s not in SETUPS:
            raise SystemExit(f"setups: unknown {s!r} (known: {', '.join(SETUPS)})")
    engine = {"model": args.model, "kv_tokens": args.kv_tokens, "block_size": 64, "chunk_size": args.chunk_size,
              "max_num_seqs": args.max_num_seqs, "threads": 1, "dtype": args.dtype}  # fmt: skip
    preset = args.preset or fit_preset(args.model, out)
    from kvbalance.raycluster.launch import start_ray

    owns = start_ray(num_cpus=max(2, os.cpu_count() or 1))
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    results = {"command": f"python benchmarks/bench_cluster_real.py {cmd}".strip(), "preset": preset,
               "args": vars(args), "setups": {n: [] for n in names}}  # fmt: skip
    try:
        if not args.no_probe:
            from kvbalance.specs import get_model

            results["round_trip_probe"] = probe_round_trips(get_model(args.model).hidden_size)
            print("round trips:", results["round_trip_probe"], flush=True)
        for k in range(args.repeats):
            order = names if k % 2 == 0 else names[::-1]  # alternate: drift in the machine's load hits both
            for name in order:
                print(f"[{k + 1}/{args.repeats}] {name}: measuring", flush=True)
                measured = measure(name, engine, args)
                simulated = predict(name, engine, preset, args)
                results["setups"][name].append({"measured": measured, "simulated": simulated})
                m, s = measured["figures"], simulated["figures"]
                print(f"  {name}: {json.dumps({f: (m[f], s[f]) for f in FIGURES})}", flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    finally:
        if owns:
            import ray

            ray.shutdown()
    write_readme(out, results, args)
    print((out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
