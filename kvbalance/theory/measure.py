"""Measuring what the stability theory predicts, in simulation: batch time b, saturation throughput, queue growth.

The theory's mu = M / (b E[g(s, o)]) needs a batch time b; the paper takes the median measured batch time
(a 10%-trimmed mean for heavy tails). Here b comes from a saturated simulated run of the same instance, and the
same run's steady throughput (completions per second between the 10th and 90th percentile completion times,
so warm-up and drain are left out) is the simulator's own mu (``saturation_from_run``; the runs themselves,
one instance or several data-parallel replicas, come from ``cluster/replicas.py``); ``queue_growth`` fits the waiting-queue trend over the arrival
period (bounded below mu (1 - delta), growing about linearly above mu).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kvbalance.metrics.summary import to_json_value
from kvbalance.metrics.timeline import Timeline
from kvbalance.request import Request
from kvbalance.theory.stability import (
    batch_time_estimate,
    memory_time_area,
    representative_batch_time,
    stable_service_rate,
)
from kvbalance.workloads.presets import build_requests, describe_workload

BEstimator = Literal["median", "trimmed_mean", "mean"]
B_ESTIMATORS = ("median", "trimmed_mean", "mean")

# ---------------------------------------------------------------------------------------------------------
# Workload side of the formula: E[g], ess sup(s + o)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadArea:
    """E[g(s, o)] of a workload (exact over its pmfs) with the length statistics behind it."""

    expected_area: float  # E[g(s, o)], token x batch-steps
    mean_input_tokens: float
    mean_output_tokens: float
    max_total_tokens: int  # ess sup(s + o), caps applied
    mean_batch_steps: float  # E[ceil(s / s_hat) + o - 1]: steps a request spends in the batch, unpreempted

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def workload_area(workload: str, chunk_size: int, max_context: int | None = None) -> WorkloadArea:
    """E[g(s, o)] for a workload string, exact: ``describe_workload(w)['lengths'].expect(g)``.

    ess sup(s + o) is the largest s + o of the (capped) pmfs: the cap itself when one applies and is
    reachable, else max(s) + max(o); trace workloads use their largest observed pair.
    """
    desc = describe_workload(workload, max_context)
    model = desc["lengths"]
    eg = model.expect(lambda s, o: memory_time_area(s, o, chunk_size))
    mean_s = model.mean_input()
    mean_o = model.mean_output()
    steps = model.expect(lambda s, o: -(-s // chunk_size) + o - 1)
    if hasattr(model, "inputs"):  # observed pairs
        sup = int((model.inputs + model.outputs).max())
    else:
        sup = int(model.input.max_value + model.output.max_value)
        if desc["max_total_tokens"] is not None:
            sup = min(sup, int(desc["max_total_tokens"]))
    return WorkloadArea(float(eg), float(mean_s), float(mean_o), sup, float(steps))


def mixture_area(parts: Sequence[WorkloadArea], weights: Sequence[float]) -> WorkloadArea:
    """A mixture of workloads (each request from part i with probability w_i): E[g] mixes linearly."""
    w = np.asarray(weights, dtype=np.float64)
    if len(parts) != len(w) or len(w) == 0 or np.any(w < 0) or not math.isclose(float(w.sum()), 1.0):
        raise ValueError("weights: need one non-negative weight per part, summing to 1")
    return WorkloadArea(
        float(sum(wi * p.expected_area for wi, p in zip(w, parts))),
        float(sum(wi * p.mean_input_tokens for wi, p in zip(w, parts))),
        float(sum(wi * p.mean_output_tokens for wi, p in zip(w, parts))),
        max(p.max_total_tokens for p, wi in zip(parts, w) if wi > 0),
        float(sum(wi * p.mean_batch_steps for wi, p in zip(w, parts))),
    )


def throughput_bounds(
    area: WorkloadArea, *, kv_capacity_tokens: int, batch_time_s: float, chunk_size: int, max_num_seqs: int
) -> dict[str, Any]:
    """The three ceilings on an instance's throughput, requests/s, and which one binds (the smallest).

    ``memory``: the paper's mu = M / (b E[g]). ``token_budget``: a step computes at most s_hat tokens and a
    request needs s + o - 1 of them, so chunk_size / (b E[s + o - 1]). ``max_num_seqs``: at most that many
    requests are in the batch, each for E[ceil(s/s_hat) + o - 1] steps (Little's law). The theory describes
    the memory-bound regime; when another ceiling is lower, mu overestimates what the instance can serve.
    """
    b = batch_time_s
    bounds = {
        "memory": stable_service_rate(kv_capacity_tokens, b, area.expected_area),
        "token_budget": chunk_size / (b * (area.mean_input_tokens + area.mean_output_tokens - 1)),
        "max_num_seqs": max_num_seqs / (b * area.mean_batch_steps),
    }
    return {**{f"{k}_bound_rps": v for k, v in bounds.items()}, "binding": min(bounds, key=bounds.get)}


def mixed_requests(
    workloads: Sequence[str],
    num_requests: int,
    rate: float,
    seed: int,
    max_context: int,
) -> list[Request]:
    """A 50/50 (or 1/k each) mixture of several workloads as one arrival stream.

    Each workload contributes num_requests / k requests at rate / k (a superposition of Poisson streams is
    Poisson at the total rate with mixed lengths); streams use disjoint prompt uids and ids are renumbered in
    arrival order. At rate inf the streams are interleaved one by one.
    """
    k = len(workloads)
    if k == 0:
        raise ValueError("workloads: need at least one workload")
    per = [num_requests // k + (1 if i < num_requests % k else 0) for i in range(k)]
    streams = [
        build_requests(w, n, rate / k if math.isfinite(rate) else rate, seed + 7919 * i, max_context,
                       uid_offset=i * 10_000_000)
        for i, (w, n) in enumerate(zip(workloads, per))
    ]  # fmt: skip
    tagged = [(r.arrival_s, j, i, r) for i, stream in enumerate(streams) for j, r in enumerate(stream)]
    tagged.sort(key=lambda t: (t[0], t[1], t[2]))  # time, then interleave by position, then stream
    out = []
    for idx, (_, _, stream, r) in enumerate(tagged):
        r.request_id = f"r{idx:06d}"
        r.meta["stream"] = stream
        out.append(r)
    return out


# ---------------------------------------------------------------------------------------------------------
# Batch time b
# ---------------------------------------------------------------------------------------------------------


def batch_time_stats(step_times_s: Sequence[float] | np.ndarray) -> dict[str, float]:
    """b by the paper's estimator (median), its heavy-tail variant (10%-trimmed mean), and the plain mean.

    ``auto`` is the paper's rule as ``representative_batch_time`` applies it (``auto_method`` says which).
    The plain mean is what turns a count of batch steps into seconds exactly; the median and trimmed mean
    are the paper's robust estimators and sit below it when step times are right-skewed (steps carrying a
    prefill chunk take several times longer than decode-only steps).
    """
    t = np.asarray(step_times_s, dtype=np.float64)
    auto, method = representative_batch_time(t, "auto")
    return {
        "auto": auto,
        "auto_method": method,
        "median": batch_time_estimate(t, "median"),
        "trimmed_mean": batch_time_estimate(t, "trimmed_mean", 0.1),
        "mean": float(t.mean()) if t.size else math.nan,
        "p10": float(np.percentile(t, 10)),
        "p90": float(np.percentile(t, 90)),
        "count": int(t.size),
    }


def steady_window(finish_times_s: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """(t10, t90): the 10th and 90th percentile completion times, the window outside warm-up and drain."""
    t = np.asarray(finish_times_s, dtype=np.float64)
    if t.size < 2:
        raise ValueError("need at least two completions to find a steady window")
    t10, t90 = np.percentile(t, [10, 90])
    return float(t10), float(t90)


def window_step_times(timeline: Timeline, t_lo: float, t_hi: float) -> np.ndarray:
    """Durations of the non-empty steps that started inside [t_lo, t_hi]."""
    t = timeline.column("time_s")
    keep = (t >= t_lo) & (t <= t_hi) & (timeline.column("batch_tokens") > 0)
    return timeline.column("step_s")[keep].copy()


# ---------------------------------------------------------------------------------------------------------
# Saturation: b and the simulator's own mu from one overloaded run
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Saturation:
    """One saturated run: the simulator's steady throughput and the batch-time estimates from its steps."""

    throughput_rps: float  # completions/s between the 10th and 90th percentile completion times
    b: dict[str, Any]  # batch_time_stats over steps inside that window (all instances pooled)
    window_s: tuple[float, float]
    num_instances: int
    num_requests: int
    preemptions: int
    kv_usage_window: float  # mean KV used / capacity over the steps in the window (step-time weighted)
    running_median: float  # median batch size (requests) inside the window
    summary: dict
    run: Any  # the ReplicaRun it was measured from
    step_times_s: np.ndarray  # the window's step durations, all instances

    def to_dict(self) -> dict[str, Any]:
        return to_json_value(
            {
                "throughput_rps": self.throughput_rps,
                "b_s": self.b["auto"],
                "b_method": self.b["auto_method"],
                "b_median_s": self.b["median"],
                "b_trimmed_mean_s": self.b["trimmed_mean"],
                "b_mean_s": self.b["mean"],
                "b_p10_s": self.b["p10"],
                "b_p90_s": self.b["p90"],
                "window_steps": self.b["count"],
                "window_s": list(self.window_s),
                "num_instances": self.num_instances,
                "num_requests": self.num_requests,
                "preemptions": self.preemptions,
                "kv_usage_window": self.kv_usage_window,
                "running_median": self.running_median,
            }
        )


def saturation_from_run(run: Any, num_instances: int) -> Saturation:
    """Steady throughput and b of a saturated run (``cluster.replicas.measure_saturation`` makes one).

    ``run`` has ``finish_times()``, ``timelines``, ``requests`` and ``summary`` (a ``ReplicaRun``). Warm-up
    and drain are left out by keeping only completions and steps between the 10th and 90th percentile
    completion times.
    """
    finish = run.finish_times()
    t10, t90 = steady_window(finish)
    thr = run.summary["steady_throughput_rps"]
    steps = np.concatenate([window_step_times(tl, t10, t90) for tl in run.timelines])
    if steps.size == 0:
        raise ValueError("saturated run has no steps inside its steady window; use more requests")
    used = cap = 0.0
    running = []
    for tl in run.timelines:
        t = tl.column("time_s")
        keep = (t >= t10) & (t <= t90)
        dt = tl.column("step_s")[keep]
        used += float(np.sum(tl.column("kv_used_tokens")[keep] * dt))
        cap += float(np.sum(tl.column("kv_capacity_tokens")[keep] * dt))
        running.append(tl.column("running")[keep])
    return Saturation(
        throughput_rps=float(thr),
        b=batch_time_stats(steps),
        window_s=(t10, t90),
        num_instances=num_instances,
        num_requests=len(run.requests),
        preemptions=int(run.summary["preemptions"]),
        kv_usage_window=used / cap if cap > 0 else math.nan,
        running_median=float(np.median(np.concatenate(running))),
        summary=run.summary,
        run=run,
        step_times_s=steps,
    )


# ---------------------------------------------------------------------------------------------------------
# Queue growth below and above mu
# ---------------------------------------------------------------------------------------------------------


def sample_and_hold(times: np.ndarray, values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The value in force at each grid time (the last row at or before it; 0 before the first row)."""
    idx = np.searchsorted(times, grid, side="right") - 1
    return np.where(idx >= 0, values[np.maximum(idx, 0)], 0.0)


def queue_growth(
    times: np.ndarray, waiting: np.ndarray, t_start: float, t_end: float, points: int = 400
) -> dict[str, Any]:
    """Trend of the waiting queue over [t_start, t_end] (the arrival period).

    The queue is sampled on a uniform grid (sample and hold) and a least-squares line is fitted: ``slope_rps``
    is requests/s of growth. ``first_quarter_mean`` / ``last_quarter_mean`` compare the two ends; the queue
    counts as ``growing`` when its last quarter averages more than twice its first quarter plus 5 requests
    and the slope is positive, i.e. it does not level off.
    """
    if not t_end > t_start:
        raise ValueError(f"t_end: must be after t_start ({t_start}), got {t_end}")
    grid = np.linspace(t_start, t_end, points)
    q = sample_and_hold(np.asarray(times, dtype=np.float64), np.asarray(waiting, dtype=np.float64), grid)
    slope, intercept = np.polyfit(grid - t_start, q, 1)
    n4 = max(1, points // 4)
    first, last = float(q[:n4].mean()), float(q[-n4:].mean())
    return {
        "t_start_s": float(t_start),
        "t_end_s": float(t_end),
        "slope_rps": float(slope),
        "intercept": float(intercept),
        "first_quarter_mean": first,
        "last_quarter_mean": last,
        "max": float(q.max()),
        "growing": bool(slope > 0 and last > 2 * first + 5),
        "grid_s": grid,
        "queue": q,
    }
