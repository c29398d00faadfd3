"""Engine profiles from the outside: ``--engine`` on cost, simulate, capacity and reproduce, the presets'
provenance, the control-plane benchmark's subtraction of the executor, and the validation harness's figures.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from kvbalance.cli import main
from kvbalance.perf.cost import CostModel, breakdown_total_s
from kvbalance.perf.engines import DEFAULT_ENGINE, ENGINES
from kvbalance.sim.run import SimulateConfig, run_simulation
from kvbalance.specs import GPUS, get_gpu, gpu_provenance, load_hardware

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # the dataclasses in it resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


COST = ["cost", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--decode-batch", "1", "--context", "128"]


def _cost_json(capsys, *extra) -> dict:
    assert main([*COST, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_cost_reports_gpu_time_and_host_time_apart_under_each_engine(capsys):
    r = {e: _cost_json(capsys, "--engine", e) for e in ("vllm-v0", "vllm-v1", "sglang", "kvbalance")}
    gpu = r["vllm-v1"]["gpu_time_s"]
    assert all(x["gpu_time_s"] == pytest.approx(gpu) for x in r.values())  # the kernels are the engine's own
    v0, v1, sgl = r["vllm-v0"]["host"], r["vllm-v1"]["host"], r["sglang"]["host"]
    # vllm-v0 pays the A40-era host time serially: 1.11 ms + 65.5 us for one sequence, nothing hidden
    assert v0["host_work_s"] == pytest.approx(get_gpu("a100-80gb").host_overhead_s(1, 1))
    assert v0["host_exposed_s"] == pytest.approx(v0["host_work_s"])
    assert v0["host_hidden_s"] == pytest.approx(0.0, abs=1e-12)
    assert r["vllm-v0"]["step_time_s"] == pytest.approx(gpu + v0["host_work_s"])
    # vllm-v1: the host work hides under the GPU step, the 160 us sync does not; one CUDA graph replay
    assert v1["cuda_graph"] and v1["host_exposed_s"] == pytest.approx(ENGINES["vllm-v1"].sync_s)
    assert v1["host_hidden_s"] == pytest.approx(v1["host_work_s"] + v1["launch_s"])
    assert r["vllm-v1"]["step_time_s"] == pytest.approx(gpu + 1.6e-4)
    assert sgl["host_exposed_s"] == pytest.approx(0.0, abs=1e-15)  # SGLang's overlap leaves no gap
    # kvbalance: its measured control plane, serial; eager launches of every kernel hide under the kernels
    kvb = r["kvbalance"]["host"]
    assert (
        not kvb["cuda_graph"]
        and kvb["launch_s"] > 1e-3
        and kvb["host_exposed_s"] == pytest.approx(kvb["host_work_s"])
    )
    assert r["vllm-v1"]["gpu_fit"] == gpu_provenance("a100-80gb") and r["vllm-v1"]["engine"] == DEFAULT_ENGINE
    assert _cost_json(capsys)["step_time_s"] == r[DEFAULT_ENGINE]["step_time_s"]  # the default


def test_cost_text_names_the_fit_gpu_and_host_lines(capsys):
    assert main([*COST, "--engine", "vllm-v0"]) == 0
    out = capsys.readouterr().out
    assert "borrows a40's fitted curves" in out and "engine: vllm-v0" in out
    step = float(re.search(r"step time: ([\d.]+) ms", out).group(1))
    gpu = float(re.search(r"GPU time: ([\d.]+) ms", out).group(1))
    exposed = float(re.search(r"host exposed: ([\d.]+) ms", out).group(1))
    assert step == pytest.approx(gpu + exposed, abs=2e-3)  # the printed parts add up (to the printed digits)
    assert (
        main(["cost", "--model", "llama-2-7b", "--gpu", "h100-sxm", "--decode-batch", "4", "--context", "9"])
        == 0
    )
    assert "own fit (measured on h100-sxm; 153 measured kernel shapes)" in capsys.readouterr().out


def test_cost_with_an_unknown_engine_is_one_line_naming_the_field(capsys):
    assert main([*COST, "--engine", "trt-llm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbalance: error: engine: unknown 'trt-llm'") and "\n" not in err


def test_the_simulate_config_takes_an_engine_and_names_a_bad_one():
    with pytest.raises(ValidationError, match=r"engine\n.*engine: unknown 'nope'"):
        SimulateConfig(engine="nope")
    base = dict(workload="fixed:64:64", rate=math.inf, num_requests=32)
    v0 = run_simulation(SimulateConfig(engine="vllm-v0", **base), report=False).summary
    default = run_simulation(SimulateConfig(**base), report=False).summary
    assert v0["engine"] == "vllm-v0" and default["engine"] == DEFAULT_ENGINE
    # the same 32 requests, in one batch: vllm-v0 adds ~1.1 ms + 65 us x 32 of serial host time to each step
    assert v0["makespan_s"] > 1.15 * default["makespan_s"]
    assert main(["simulate", "--engine", "nope", "--no-progress"]) == 2


def test_capacity_takes_the_engine_and_reports_it(capsys):
    args = ["capacity", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--workload", "uniform:16-64:16-64",
            "--kv-tokens", "8000", "--b-requests", "60", "--rate", "5", "--json"]  # fmt: skip
    assert main([*args, "--engine", "vllm-v0"]) == 0
    v0 = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    default = json.loads(capsys.readouterr().out)
    assert (v0["engine"], default["engine"]) == ("vllm-v0", DEFAULT_ENGINE)
    assert v0["b_s"] > default["b_s"]  # the serial host time lengthens the batch time b


def test_reproduce_engine_is_the_default_of_the_experiments_cost_models(monkeypatch, tmp_path, capsys):
    seen = []

    def run(out, quick):
        seen.append(CostModel("llama-2-7b", "h100-sxm").engine.name)
        return {"engine": seen[-1]}

    import importlib

    import kvbalance.commands.reproduce as cmd

    def import_module(name):
        return (
            SimpleNamespace(run=run)
            if name.startswith("kvbalance.reproduce.")
            else importlib.import_module(name)
        )

    monkeypatch.setattr(cmd, "importlib", SimpleNamespace(import_module=import_module))
    assert main(["reproduce", "elastic", "--engine", "sglang", "--out", str(tmp_path)]) == 0
    assert main(["reproduce", "elastic", "--out", str(tmp_path)]) == 0
    assert seen == ["sglang", DEFAULT_ENGINE]
    assert CostModel("llama-2-7b", "h100-sxm").engine.name == DEFAULT_ENGINE  # not left set afterwards
    capsys.readouterr()
    assert main(["reproduce", "elastic", "--engine", "nope", "--out", str(tmp_path)]) == 2


def test_gpu_provenance_says_which_gpus_have_their_own_fit(tmp_path):
    own = {g for g in GPUS if gpu_provenance(g)["own_fit"]}
    assert own == {"a40", "h100-sxm"}
    borrowed = {g: gpu_provenance(g)["borrowed_from"] for g in GPUS if g not in own}
    assert borrowed == {"a100-40gb": "a40", "a100-80gb": "a40", "l40s": "a40", "h200": "h100-sxm"}
    assert gpu_provenance("h100-sxm")["shape_corrections"] == 153
    assert gpu_provenance("h200")["shape_corrections"] == 0
    guess = get_gpu("h100-sxm").with_(name="mine", fitted_on="", shape_corrections={})
    assert gpu_provenance(guess) == {
        "fitted_on": None,
        "own_fit": False,
        "borrowed_from": None,
        "shape_corrections": 0,
        "measured_overrides": {},
        "summary": "no fit: datasheet peaks with estimated efficiencies",
    }
    a100 = gpu_provenance("a100-80gb")
    assert a100["borrowed_from"] == "a40" and a100["measured_overrides"] == {"memory_eff_max": 0.88}
    assert "own measured memory_eff_max 0.88" in a100["summary"]
    path = tmp_path / "a100.json"
    get_gpu("a100-80gb").save(path)
    assert load_hardware(path).fitted_on == "a40"  # the field survives a preset file


def test_control_plane_benchmark_takes_the_executors_time_out():
    bench = _load("bench_control_plane")

    class SlowCost:
        """The cost model with 3 ms of CPU burnt per step (a stand-in for a slow executor)."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def predict(self, plan):
            t0 = time.process_time()
            while time.process_time() - t0 < 3e-3:
                pass
            return self.inner.predict(plan)

    point = bench._Point("decode", 4, seed=0)
    point.ex.inner.step_model = SlowCost(point.ex.inner.cost_model)
    samples = [point.measure() for _ in range(5)]
    assert all(n == 4 and t == 4 for _, n, t in samples)  # a decode step of the 4 running sequences
    # the 3 ms inside the executor are not the control plane's: were they counted, every sample would take more
    # than 3 ms; the fastest one (not the slowest: a CPU-time sample can still catch a busy machine's stall)
    assert min(s for s, _, _ in samples) < 1.5e-3
    assert point.ex.last_s >= 3e-3
    pre = bench._Point("prefill", 256, seed=1)
    assert [pre.measure()[1:] for _ in range(2)] == [(1, 256), (1, 256)]  # a fresh prompt each step


def test_validation_harness_computes_gpt_fast_tokens_per_second_from_the_steps():
    val = _load("validate_e2e")
    row = next(r for r in val.ROWS if r.id == "gpt-fast-7b-tp1")
    cm = CostModel(row.model, row.gpu, row.tp, engine=row.profile)
    # a 5-token prefill that samples the first token, then 199 decodes at contexts 6..204
    steps = [breakdown_total_s(cm.step([(5, 5, True)]))]
    steps += [breakdown_total_s(cm.step([(1, c, True)])) for c in range(6, 205)]
    assert val.simulate(row)["value"] == pytest.approx(200 / sum(steps), rel=1e-6)  # the clock sums in order
    assert {r.profile for r in val.ROWS} <= set(ENGINES)
    assert len({r.id for r in val.ROWS}) == len(val.ROWS) >= 8
    assert all(r.source.startswith("https://") and r.measured > 0 for r in val.ROWS)
    md = val.table(
        [
            {**r.__dict__, "simulated": 2 * r.measured, "error": 1.0, "seeds": [], "others": {}}
            for r in val.ROWS[:2]
        ]
    )
    assert md.endswith("2 rows: median |error| 100.0%, worst 100.0%")


def test_validation_throughput_requests_hold_the_benchmark_samples_totals_within_its_filter():
    val = _load("validate_e2e")
    from kvbalance.workloads.presets import SHAREGPT_LENGTHS_CSV, default_traces_dir

    if not (default_traces_dir() / SHAREGPT_LENGTHS_CSV).is_file():
        pytest.skip(f"ShareGPT lengths trace not found in {default_traces_dir()}")
    for seed in (0, 3):
        reqs = val.benchmark_sharegpt_requests(seed)
        p = [len(r.prompt_token_ids) for r in reqs]
        o = [r.sampling.max_tokens for r in reqs]
        assert len(reqs) == val.VLLM_SHAREGPT_PROMPTS == 200
        # benchmark_throughput's sample: 42,659 prompt and 43,545 output tokens (to the rounding)
        assert abs(sum(p) - val.VLLM_SHAREGPT_PROMPT_TOKENS) <= 2
        assert abs(sum(o) - val.VLLM_SHAREGPT_OUTPUT_TOKENS) <= 2
        assert min(p) >= 4 and min(o) >= 4 and max(p) <= 1024 and max(a + b for a, b in zip(p, o)) <= 2048
        assert all(r.arrival_s == 0.0 and r.sampling.ignore_eos for r in reqs)
        assert len({tuple(r.prompt_token_ids[:4]) for r in reqs}) == 200  # no shared prefixes
        assert [r.sampling.max_tokens for r in val.benchmark_sharegpt_requests(seed)] == o  # seeded
    assert [r.sampling.max_tokens for r in val.benchmark_sharegpt_requests(0)] != o  # seeds differ
