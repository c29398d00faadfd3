"""``kvbalance profile``: time the real executor on this machine, fit a hardware preset for it, and check the
fitted preset by simulating a workload that the real engine also runs.

Three stages, each writing one file under ``--out``:

1. profile: a grid of prefill chunks, decode batches at several contexts and mixed steps, each timed as the
   engine times it (``TorchExecutor.execute`` on a ``BatchPlan``; warm-up first, median of repeats);
2. fit: :func:`kvbalance.perf.calibrate.fit_hardware` from :func:`cpu_base_spec` -> ``hardware.json`` (a preset
   ``simulate --gpu DIR/hardware.json`` accepts) and ``profile.json`` (samples, fitted parameters, errors);
3. validate: the same requests (ShareGPT-like lengths, all at time 0, EOS ignored) through the real
   ``LLMEngine`` and through the simulator on the fitted preset, same scheduler and KV capacity ->
   ``validation.json`` (output tokens/s and makespan, real vs predicted, and per-step errors).

The cost model counts bytes at the preset ``ModelSpec``'s dtype (2 bytes for every preset) while the executor
runs float32; the fitted memory efficiencies absorb that factor, and the simulator uses the same spec, so
fitted presets are consistent with ``simulate`` on the same model name (not portable to other dtypes).
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvbalance.perf.calibrate import CalibrationResult, cpu_base_spec, fit_hardware, predict_samples
from kvbalance.perf.cost import CostModel, SeqWork
from kvbalance.specs import get_model

DEFAULT_OUT = "runs/profile"
# The engine's knobs shared by the real run and the simulation (LLMEngine's defaults).
FIT_PARAMS = (
    "compute_eff_max",
    "memory_eff_max",
    "attention_eff_ratio",
    "kv_memory_eff_ratio",
    "step_overhead_s",
    "compute_half_tokens",
)


@dataclass
class ProfileConfig:
    """What a profile run measures and how the validation run is set up."""

    model: str = "smollm2-135m"
    threads: int = 1
    quick: bool = False
    block_size: int = 64  # LLMEngine's default on CPU
    warmup: int = 1
    repeats: int = 3
    max_repeat_s: float = 4.0  # stop repeating a grid point once this much time went into it (>= 1 repeat)
    seed: int = 0
    fit: tuple[str, ...] = FIT_PARAMS
    # "wall": fit and validate on wall-clock time (what the engine's clock sees); "cpu": on the process's CPU
    # time, which on a shared machine approximates the uncontended time (one compute thread)
    clock: str = "wall"
    # validation
    validate: bool = True
    workload: str = "sharegpt-trace"  # lengths source; falls back to "sharegpt" when the trace is missing
    num_requests: int = 32
    max_input_tokens: int = 512
    max_output_tokens: int = 128
    chunk_size: int = 512  # sarathi token budget per step (LLMEngine max_num_batched_tokens)
    max_num_seqs: int = 64
    kv_tokens: int = 32_768
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for f in ("threads", "block_size", "repeats", "num_requests", "max_input_tokens", "max_output_tokens",
                  "chunk_size", "max_num_seqs", "kv_tokens"):  # fmt: skip
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: must be a positive integer, got {v!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup: must be >= 0, got {self.warmup}")
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"clock: must be 'wall' or 'cpu', got {self.clock!r}")
        if not self.max_repeat_s > 0:
            raise ValueError(f"max_repeat_s: must be > 0, got {self.max_repeat_s}")
        get_model(self.model)

    @classmethod
    def quick_config(cls, model: str = "tiny-llama", **kw) -> ProfileConfig:
        """Seconds, not minutes: a handful of grid points and a small validation run (tests, smoke checks)."""
        base = dict(quick=True, repeats=2, max_repeat_s=1.0, num_requests=8, max_input_tokens=128,
                    max_output_tokens=16, chunk_size=128, max_num_seqs=16, kv_tokens=4096)  # fmt: skip
        base.update(kw)
        return cls(model=model, **base)


# -- the grid -----------------------------------------------------------------------------------------


@dataclass
class GridPoint:
    """One step shape: ``seqs`` = [(num_new_tokens, context_len_after_step, samples)] (cost.py's SeqWork)."""

    name: str
    seqs: list[SeqWork]


def profile_grid(quick: bool, max_context: int) -> list[GridPoint]:
    """Prefill chunks (fresh and after a context), decode batches x contexts and mixed steps (decodes plus
    one prefill chunk, as Sarathi-style batching makes them). Contexts are clipped to ``max_context``."""
    if quick:
        prefill, chunked = (8, 32, 96), ((32, 96),)
        batches, contexts = (1, 4, 16), (16, 96)
        mixed = ((4, 64, 32),)
    else:
        prefill, chunked = (16, 64, 256, 512), ((128, 512), (512, 1024))
        batches, contexts = (1, 4, 16, 32, 64), (64, 256, 1024)
        mixed = ((8, 256, 248), (32, 512, 224), (63, 256, 449), (16, 1024, 496))
    cap = max_context
    grid = [GridPoint(f"prefill-{n}", [(n, n, True)]) for n in prefill if n <= cap]
    grid += [GridPoint(f"chunk-{n}@{c}", [(n, c, True)]) for n, c in chunked if c <= cap]
    for b in batches:
        for c in contexts:
            if c <= cap:
                grid.append(GridPoint(f"decode-{b}x{c}", [(1, c, True)] * b))
    for b, c, n in mixed:
        if c <= cap and n <= cap:
            grid.append(GridPoint(f"mixed-{b}x{c}+{n}", [(1, c, True)] * b + [(n, n, True)]))
    return grid


# -- measuring real steps -----------------------------------------------------------------------------


def _build_executor(model: str, num_blocks: int, block_size: int, threads: int, seed: int):
    import torch

    from kvbalance.executor.torch import TorchExecutor
    from kvbalance.model.weights import load_model

    loaded = load_model(model, seed=seed)
    ex = TorchExecutor(
        loaded.config, loaded.state_dict, num_blocks, block_size, "cpu", torch.float32, threads
    )
    return ex, loaded.config


def _plan(point: GridPoint, block_size: int, vocab: int, rng: np.random.Generator):
    """A BatchPlan for ``point``: one Request per sequence on its own blocks, with random token ids."""
    from kvbalance.batch import BatchPlan, ScheduledSeq
    from kvbalance.request import Request, SamplingParams

    seqs, next_block = [], 0
    for i, (n, ctx, sample) in enumerate(point.seqs):
        req = Request(
            f"p{i}", rng.integers(0, vocab, ctx).tolist(), SamplingParams(max_tokens=2, ignore_eos=True)
        )
        blocks = -(-ctx // block_size)
        req.block_ids = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(ScheduledSeq(req, ctx - n, n, sample))
    return BatchPlan(seqs, block_size)


@dataclass
class StepSample:
    """A grid point's measurement (seconds): median of repeats of the executor's step time."""

    name: str
    seqs: list[SeqWork]
    step_s: float  # StepResult.duration_s, median (what the engine's clock sees)
    forward_s: float  # StepBreakdown.compute_s, median (the model forward alone)
    min_step_s: float
    cpu_s: float  # thread CPU time of the step, median (near the step time unless the machine is shared)
    repeats: int
    predicted_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _, _ in self.seqs)


def measure_grid(
    executor,
    grid: Sequence[GridPoint],
    *,
    vocab: int,
    warmup: int = 1,
    repeats: int = 3,
    max_repeat_s: float = 4.0,
    seed: int = 0,
    progress: Callable[[StepSample], None] | None = None,
) -> list[StepSample]:
    """Time each grid point with ``executor.execute`` (after ``warmup`` untimed runs of the first point)."""
    rng = np.random.default_rng(seed)
    bs = executor.block_size
    if grid and warmup:
        first = _plan(grid[0], bs, vocab, rng)
        for _ in range(warmup):
            executor.execute(first)
    out = []
    for point in grid:
        need = sum(-(-c // bs) for _, c, _ in point.seqs)
        if need > executor.num_blocks:
            raise ValueError(
                f"kv_tokens: grid point {point.name} needs {need} blocks, executor has {executor.num_blocks}"
            )
        plan = _plan(point, bs, vocab, rng)
        executor.execute(plan)  # per-shape warm-up (allocator, oneDNN primitive caches)
        steps, fwds, cpus = [], [], []
        spent = time.perf_counter()
        for _ in range(repeats):
            c0 = time.thread_time()
            res = executor.execute(plan)
            cpus.append(time.thread_time() - c0)
            steps.append(res.duration_s)
            fwds.append(res.breakdown.compute_s)
            if time.perf_counter() - spent > max_repeat_s:
                break
        sample = StepSample(point.name, list(point.seqs), statistics.median(steps), statistics.median(fwds),
                            min(steps), statistics.median(cpus), len(steps))  # fmt: skip
        out.append(sample)
        if progress is not None:
            progress(sample)
    return out


def kv_blocks_for_grid(grid: Sequence[GridPoint], block_size: int) -> int:
    return max(sum(-(-c // block_size) for _, c, _ in p.seqs) for p in grid)


# -- fitting ------------------------------------------------------------------------------------------


def measure_peaks(threads: int = 1, repeats: int = 3) -> dict[str, float]:
    """This machine's fp32 GEMM rate (1024^3 matmul) and copy bandwidth (64 MiB arrays), best of ``repeats``,
    on thread CPU time (so another process sharing the cores does not lower them)."""
    import torch

    torch.set_num_threads(threads)
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    src, dst = np.ones(16 << 20, dtype=np.float32), np.empty(16 << 20, dtype=np.float32)
    a @ b
    np.copyto(dst, src)
    clock = time.thread_time if threads == 1 else time.process_time
    gemm, copy = math.inf, math.inf
    for _ in range(repeats):
        t = clock()
        a @ b
        gemm = min(gemm, clock() - t)
        t = clock()
        np.copyto(dst, src)
        copy = min(copy, clock() - t)
    return {
        "peak_flops": 2.0 * n**3 / max(gemm, 1e-9),
        "mem_bandwidth_bytes_s": 2.0 * src.nbytes / max(copy, 1e-9),
    }


def fit_cpu_preset(
    model: str,
    samples: Sequence[StepSample],
    fit: Sequence[str] = FIT_PARAMS,
    name: str | None = None,
    clock: str = "wall",
    peaks: dict[str, float] | None = None,
) -> CalibrationResult:
    """Fit ``cpu_base_spec()``'s ``fit`` fields to the samples' median step times (``clock`` "wall": step_s,
    "cpu": cpu_s); fills each sample's ``predicted_s``. ``peaks`` (from :func:`measure_peaks`) replace the
    base spec's guessed peak FLOP/s and bandwidth, so the fitted efficiencies are fractions of measured rates
    (the guessed 20 GB/s floor is far above one core of a shared VM, and the fit then stalls far from the optimum).
    """
    base = cpu_base_spec(num_cores=1, name=name or "cpu")  # one compute thread per engine
    if peaks:
        base = base.with_(**peaks, source=base.source + "; peaks measured by kvbalance.profile.measure_peaks")
    pairs = [(s.seqs, s.cpu_s if clock == "cpu" else s.step_s) for s in samples]
    # Nelder-Mead finds local optima here (a large step overhead can stand in for weight streaming): start it
    # from several memory efficiencies and keep the fit with the lowest median error.
    result = min(
        (
            fit_hardware(model, base.with_(memory_eff_max=m), pairs, fit=fit, name=name)
            for m in (0.7, 0.2, 0.05)
        ),
        key=lambda r: (r.median_rel_error, r.mean_rel_error),
    )
    pred = predict_samples(model, result.hardware, pairs)
    for s, p in zip(samples, pred):
        s.predicted_s = float(p)
    return result


# -- validation ---------------------------------------------------------------------------------------


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


# -- the whole command ----------------------------------------------------------------------------------


def run_profile(cfg: ProfileConfig, out_dir: str | Path, log: Callable[[str], None] = print) -> dict:
    """Profile -> fit -> (validate); writes hardware.json, profile.json and validation.json under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = get_model(cfg.model)
    grid = profile_grid(cfg.quick, spec.max_context)
    num_blocks = kv_blocks_for_grid(grid, cfg.block_size)
    ex, config = _build_executor(cfg.model, num_blocks, cfg.block_size, cfg.threads, cfg.seed)
    log(f"profiling {cfg.model} on {len(grid)} step shapes, {cfg.threads} thread(s)")
    t0 = time.perf_counter()

    def show(s: StepSample) -> None:
        log(
            f"  {s.name:<22} {s.num_tokens:>5} tok  step {1e3 * s.step_s:9.1f} ms  fwd {1e3 * s.forward_s:9.1f} ms"
        )

    samples = measure_grid(ex, grid, vocab=config.vocab_size, warmup=cfg.warmup, repeats=cfg.repeats,
                           max_repeat_s=cfg.max_repeat_s, seed=cfg.seed, progress=show)  # fmt: skip
    profile_s = time.perf_counter() - t0
    del ex
    gc.collect()

    name = f"cpu-{cfg.model}-{cfg.threads}t"
    peaks = measure_peaks(cfg.threads)
    fit = fit_cpu_preset(cfg.model, samples, cfg.fit, name=name, clock=cfg.clock, peaks=peaks)
    hw_path = out / "hardware.json"
    fit.hardware.save(hw_path)
    profile = {
        "model": cfg.model,
        "threads": cfg.threads,
        "dtype": "float32",
        "config": asdict(cfg),
        "profile_s": profile_s,
        "measured_peaks": peaks,
        "fit": fit.to_dict(),
        "samples": [
            {
                "name": s.name,
                "num_tokens": s.num_tokens,
                "num_seqs": len(s.seqs),
                "seqs": _compact(s.seqs),
                "step_s": s.step_s,
                "forward_s": s.forward_s,
                "min_step_s": s.min_step_s,
                "cpu_s": s.cpu_s,
                "repeats": s.repeats,
                "predicted_s": s.predicted_s,
                "rel_error": s.predicted_s / (s.cpu_s if cfg.clock == "cpu" else s.step_s) - 1.0,
            }
            for s in samples
        ],  # fmt: skip
    }
    _write_json(out / "profile.json", profile)
    log(
        f"fit ({', '.join(cfg.fit)}): median |error| {100 * fit.median_rel_error:.1f}% "
        f"(max {100 * fit.max_rel_error:.1f}%, base spec {100 * fit.base_median_rel_error:.1f}%)"
    )
    for k, v in fit.params.items():
        log(f"  {k} = {v:.4g}")
    log(f"wrote {hw_path} and {out / 'profile.json'}")
    result = {"profile": profile, "hardware_path": str(hw_path)}
    if cfg.validate:
        log(f"validating: {cfg.num_requests} requests through the real engine and the simulator")
        v = validate(cfg, hw_path, config.vocab_size, min(spec.max_context, config.max_context))
        _write_json(out / "validation.json", v)
        r, p = v["real"], v["predicted"]
        cpu_clock = cfg.clock == "cpu"
        tps, mk = (
            ("cpu_output_tokens_per_s", "cpu_makespan_s")
            if cpu_clock
            else ("output_tokens_per_s", "makespan_s")
        )
        log(f"  {'(' + cfg.clock + ' clock)':<22}{'real':>12}{'predicted':>12}{'error':>9}")
        log(f"  {'output tokens/s':<22}{r[tps]:>12.2f}{p['output_tokens_per_s']:>12.2f}"
            f"{100 * v['throughput_rel_error']:>+8.1f}%")  # fmt: skip
        log(f"  {'makespan (s)':<22}{r[mk]:>12.2f}{p['makespan_s']:>12.2f}"
            f"{100 * v['makespan_rel_error']:>+8.1f}%")  # fmt: skip
        log(
            f"  real run, wall clock: {r['output_tokens_per_s']:.2f} tok/s over {r['makespan_s']:.2f} s; "
            f"CPU time: {r['cpu_output_tokens_per_s']:.2f} tok/s over {r['cpu_makespan_s']:.2f} s"
        )
        log(f"  {'steps':<22}{r['num_steps']:>12}{p['num_steps']:>12}")
        rs = v["real_steps"]
        if rs["num_steps"]:
            log(f"  cost model on the real run's steps: {rs['predicted_s']:.2f} s predicted vs "
                f"{rs['measured_s']:.2f} s measured; host time outside the executor {r['host_outside_executor_s']:.2f} s")  # fmt: skip
        log(f"  within 20%: {'yes' if v['within_20pct'] else 'NO'}; wrote {out / 'validation.json'}")
        result["validation"] = v
    return result


def _compact(seqs: Sequence[SeqWork]) -> list[list]:
    """Run-length [count, num_new_tokens, context_len, samples] rows (a decode batch is one row)."""
    rows: list[list] = []
    for n, c, s in seqs:
        if rows and rows[-1][1:] == [n, c, bool(s)]:
            rows[-1][0] += 1
        else:
            rows.append([1, n, c, bool(s)])
    return rows


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, (tuple, set)):
        return list(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


__all__ = [
    "GridPoint",
    "ProfileConfig",
    "StepSample",
    "fit_cpu_preset",
    "measure_grid",
    "profile_grid",
    "run_profile",
    "validate",
]
