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

The stages live in one module each: :mod:`.config` (:class:`ProfileConfig`), :mod:`.grid` (the step shapes and
their timing), :mod:`.fit` (measured peaks and the fitted preset) and :mod:`.validation` (real vs predicted);
this module runs them in order and writes the files.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from kvbalance.perf.calibrate import CalibrationResult
from kvbalance.perf.cost import SeqWork
from kvbalance.profile.config import DEFAULT_OUT, FIT_PARAMS, ProfileConfig
from kvbalance.profile.fit import fit_cpu_preset, measure_peaks
from kvbalance.profile.grid import (
    GridPoint,
    StepSample,
    _build_executor,
    kv_blocks_for_grid,
    measure_grid,
    profile_grid,
)
from kvbalance.profile.validation import run_predicted, run_real, validate, validation_lengths
from kvbalance.specs import get_model


def run_profile(cfg: ProfileConfig, out_dir: str | Path, log: Callable[[str], None] = print) -> dict:
    """Profile -> fit -> (validate); writes hardware.json, profile.json and validation.json under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = get_model(cfg.model)
    samples, profile_s, config = _profile_steps(cfg, spec.max_context, log)

    name = f"cpu-{cfg.model}-{cfg.threads}t"
    peaks = measure_peaks(cfg.threads)
    fit = fit_cpu_preset(cfg.model, samples, cfg.fit, name=name, clock=cfg.clock, peaks=peaks)
    hw_path = out / "hardware.json"
    fit.hardware.save(hw_path)
    profile = _profile_report(cfg, profile_s, peaks, fit, samples)
    _write_json(out / "profile.json", profile)
    _log_fit(cfg, fit, log)
    log(f"wrote {hw_path} and {out / 'profile.json'}")
    result = {"profile": profile, "hardware_path": str(hw_path)}
    if cfg.validate:
        log(f"validating: {cfg.num_requests} requests through the real engine and the simulator")
        v = validate(cfg, hw_path, config.vocab_size, min(spec.max_context, config.max_context))
        _write_json(out / "validation.json", v)
        _log_validation(cfg, v, log)
        log(f"  within 20%: {'yes' if v['within_20pct'] else 'NO'}; wrote {out / 'validation.json'}")
        result["validation"] = v
    return result


def _profile_steps(cfg: ProfileConfig, max_context: int, log: Callable[[str], None]):
    """Stage 1: time the grid on a fresh executor (freed before returning) -> (samples, seconds, model config)."""
    grid = profile_grid(cfg.quick, max_context)
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
    return samples, profile_s, config


def _profile_report(
    cfg: ProfileConfig,
    profile_s: float,
    peaks: dict[str, float],
    fit: CalibrationResult,
    samples: Sequence[StepSample],
) -> dict:
    """profile.json: the run's setup, the measured peaks, the fit and every sample with its predicted time."""
    return {
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


def _log_fit(cfg: ProfileConfig, fit: CalibrationResult, log: Callable[[str], None]) -> None:
    log(
        f"fit ({', '.join(cfg.fit)}): median |error| {100 * fit.median_rel_error:.1f}% "
        f"(max {100 * fit.max_rel_error:.1f}%, base spec {100 * fit.base_median_rel_error:.1f}%)"
    )
    for k, v in fit.params.items():
        log(f"  {k} = {v:.4g}")


def _log_validation(cfg: ProfileConfig, v: dict, log: Callable[[str], None]) -> None:
    """The real-vs-predicted table on the config's clock, the real run on both clocks, and the per-step check."""
    r, p = v["real"], v["predicted"]
    cpu_clock = cfg.clock == "cpu"
    tps, mk = (
        ("cpu_output_tokens_per_s", "cpu_makespan_s") if cpu_clock else ("output_tokens_per_s", "makespan_s")
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
    "DEFAULT_OUT",
    "FIT_PARAMS",
    "GridPoint",
    "ProfileConfig",
    "StepSample",
    "fit_cpu_preset",
    "kv_blocks_for_grid",
    "measure_grid",
    "measure_peaks",
    "profile_grid",
    "run_predicted",
    "run_profile",
    "run_real",
    "validate",
    "validation_lengths",
]
