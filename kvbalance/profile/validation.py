"""Validating a fitted preset: the same requests (ShareGPT-like lengths, all at time 0, EOS ignored) through the
real ``LLMEngine`` and through the simulator on the fitted preset, same scheduler and KV capacity; errors are
(predicted - real) / real, for the whole run and for the cost model on the real run's own steps."""

from __future__ import annotations

import gc
import math
import time
from pathlib import Path

import numpy as np

from kvbalance.perf.calibrate import predict_samples
from kvbalance.perf.cost import CostModel, SeqWork
from kvbalance.profile.config import ProfileConfig


def validation_lengths(cfg: ProfileConfig, max_context: int) -> tuple[str, list[tuple[int, int]]]:
    """(input, output) pairs: ShareGPT trace lengths (seeded draw) capped at the config's limits."""
    from kvbalance.workloads.presets import build_requests

    workload = cfg.workload
    cap_ctx = min(max_context, cfg.max_input_tokens + cfg.max_output_tokens)
    try:
        reqs = build_requests(workload, cfg.num_requests, math.inf, cfg.seed, max(cap_ctx, 2))
    except ValueError:
        if workload != "sharegpt-trace":
            raise
        workload = "sharegpt"
        reqs = build_requests(workload, cfg.num_requests, math.inf, cfg.seed, max(cap_ctx, 2))
    pairs = []
    for r in reqs:
        i = max(1, min(r.num_prompt_tokens, cfg.max_input_tokens))
        o = max(1, min(r.max_tokens, cfg.max_output_tokens, max_context - i))
        pairs.append((i, o))
    return workload, pairs


class _RecordingExecutor:
    """Wraps an executor and keeps (seqs, measured seconds) of every step it runs."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.log: list[tuple[list[SeqWork], float, float]] = []  # (seqs, wall s, thread CPU s)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, plan):
        c0 = time.thread_time()
        result = self.inner.execute(plan)
        self.log.append((CostModel.plan_seqs(plan), result.duration_s, time.thread_time() - c0))
        return result


def run_real(cfg: ProfileConfig, prompts: list[list[int]], outputs: list[int]) -> dict:
    """All requests at time 0 through ``LLMEngine`` (greedy, EOS ignored); wall-clock throughput and makespan."""
    from kvbalance.llm import LLMEngine
    from kvbalance.request import RequestState, SamplingParams

    eng = LLMEngine(
        cfg.model,
        kv_cache_tokens=cfg.kv_tokens,
        block_size=cfg.block_size,
        max_num_batched_tokens=cfg.chunk_size,
        max_num_seqs=cfg.max_num_seqs,
        policy="sarathi",
        enable_prefix_caching=cfg.enable_prefix_caching,
        num_threads=cfg.threads,
        seed=cfg.seed,
    )
    rec = _RecordingExecutor(eng.instance.executor)
    eng.instance.executor = rec
    # warm-up: one short request on ids no validation prompt starts with
    eng.add_request([1] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    eng.run_until_done()
    rec.log.clear()
    eng.step_log.clear()

    t0, c0 = time.perf_counter(), time.process_time()
    reqs = [
        eng.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True)) for p, o in zip(prompts, outputs)
    ]
    eng.run_until_done()
    makespan, cpu = time.perf_counter() - t0, time.process_time() - c0
    bad = [r.request_id for r in reqs if r.state is not RequestState.FINISHED]
    if bad:
        raise RuntimeError(f"validation: real run left {len(bad)} requests unfinished or rejected: {bad[:4]}")
    out_tokens = sum(r.num_output_tokens for r in reqs)
    step_s = sum(d for _, _, d, _ in eng.step_log)
    forward_s = sum(f for _, _, _, f in eng.step_log)
    return {
        "makespan_s": makespan,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / makespan,
        "cpu_makespan_s": cpu,
        "cpu_output_tokens_per_s": out_tokens / cpu,
        "num_steps": len(eng.step_log),
        "executor_s": step_s,
        "forward_s": forward_s,
        "host_outside_executor_s": makespan - step_s,
        "preemptions": eng.instance.load().num_preemptions,
        "_steps": list(rec.log),
    }


def run_predicted(
    cfg: ProfileConfig, hardware_path: Path, prompts: list[list[int]], outputs: list[int]
) -> dict:
    """The same requests through ``run_simulation`` on the fitted preset (same scheduler and KV capacity)."""
    from kvbalance.request import Request, SamplingParams
    from kvbalance.sim.run import SimulateConfig, run_simulation

    sim_cfg = SimulateConfig(
        model=cfg.model,
        gpu=str(hardware_path),
        rate=math.inf,
        num_requests=len(prompts),
        policy="sarathi",
        chunk_size=cfg.chunk_size,
        max_num_seqs=cfg.max_num_seqs,
        block_size=cfg.block_size,
        kv_tokens=cfg.kv_tokens,
        enable_prefix_caching=cfg.enable_prefix_caching,
        seed=cfg.seed,
    )
    reqs = [
        Request(f"v{i}", list(p), SamplingParams(max_tokens=o, ignore_eos=True), arrival_s=0.0)
        for i, (p, o) in enumerate(zip(prompts, outputs))
    ]
    result = run_simulation(sim_cfg, requests=reqs, report=False)
    run = result.run
    if run.unfinished:
        raise RuntimeError(f"validation: simulation left {len(run.unfinished)} requests unfinished")
    out_tokens = sum(r.num_output_tokens for r in run.requests)
    return {
        "makespan_s": run.makespan_s,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / run.makespan_s,
        "num_steps": run.num_steps,
        "preemptions": result.instance.load().num_preemptions,
    }


def _rel(pred: float, real: float) -> float:
    return (pred - real) / real if real else math.inf


def validate(cfg: ProfileConfig, hardware_path: Path, vocab: int, max_context: int) -> dict:
    """Real engine vs simulation on the fitted preset for one workload; errors are (predicted - real) / real."""
    from kvbalance.specs import load_hardware

    workload, pairs = validation_lengths(cfg, max_context)
    rng = np.random.default_rng(cfg.seed + 1)
    # random ids; 0..2 avoided so no prompt shares the warm-up's blocks or hits special tokens
    prompts = [rng.integers(3, vocab, i).tolist() for i, _ in pairs]
    outputs = [o for _, o in pairs]
    real = run_real(cfg, prompts, outputs)
    steps = real.pop("_steps")
    gc.collect()
    pred = run_predicted(cfg, hardware_path, prompts, outputs)
    hw = load_hardware(hardware_path)
    cpu_clock = cfg.clock == "cpu"
    step_real = np.array([c if cpu_clock else w for _, w, c in steps])
    step_pred = predict_samples(cfg.model, hw, [(s, 1.0) for s, _, _ in steps]) if steps else np.zeros(0)
    step_rel = np.abs(step_pred - step_real) / step_real if steps else np.zeros(0)
    real_tps = real["cpu_output_tokens_per_s" if cpu_clock else "output_tokens_per_s"]
    real_mk = real["cpu_makespan_s" if cpu_clock else "makespan_s"]
    thr_err = _rel(pred["output_tokens_per_s"], real_tps)
    mk_err = _rel(pred["makespan_s"], real_mk)
    return {
        "workload": {
            "lengths": workload,
            "num_requests": len(pairs),
            "input_tokens": sum(i for i, _ in pairs),
            "output_tokens": sum(outputs),
            "max_input_tokens": cfg.max_input_tokens,
            "max_output_tokens": cfg.max_output_tokens,
            "arrival": "all at time 0",
        },
        "scheduler": {
            "policy": "sarathi",
            "chunk_size": cfg.chunk_size,
            "max_num_seqs": cfg.max_num_seqs,
            "kv_tokens": cfg.kv_tokens,
            "block_size": cfg.block_size,
            "enable_prefix_caching": cfg.enable_prefix_caching,
        },  # fmt: skip
        "clock": cfg.clock,
        "real": real,
        "predicted": pred,
        "throughput_rel_error": thr_err,
        "makespan_rel_error": mk_err,
        "within_20pct": abs(thr_err) <= 0.2 and abs(mk_err) <= 0.2,
        # the cost model on the real run's own steps: separates model error from schedule divergence and host time
        "real_steps": {
            "num_steps": len(steps),
            "measured_s": float(step_real.sum()),
            "predicted_s": float(step_pred.sum()),
            "sum_rel_error": _rel(float(step_pred.sum()), float(step_real.sum())) if steps else None,
            "median_step_rel_error": float(np.median(step_rel)) if steps else None,
            # per step: [tokens, seqs, prefill tokens, max context, measured s, predicted s]
            "steps": [
                [
                    sum(n for n, _, _ in sq),
                    len(sq),
                    sum(n for n, _, _ in sq if n > 1),
                    max(c for _, c, _ in sq),
                    round(float(m), 6),
                    round(float(p), 6),
                ]
                for (sq, _, _), m, p in zip(steps, step_real, step_pred)
            ],  # fmt: skip
        },
    }
