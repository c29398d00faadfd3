"""Aggregate serving metrics over finished requests: throughput, goodput, latency percentiles, KV usage.

``summarize`` returns a flat dict of JSON-native values (ints, floats rounded to 6 decimals,
``None`` where a value is undefined, never NaN) so results compare bit for bit across runs.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvbalance.metrics.timeline import Timeline, kv_usage_mean
from kvbalance.request import Request, RequestState

DECIMALS = 6
LATENCY_KEYS = ("mean", "p50", "p90", "p99")
REQUEST_CSV_COLUMNS = (
    "request_id",
    "arrival_s",
    "num_prompt_tokens",
    "num_output_tokens",
    "state",
    "reject_reason",
    "queue_delay_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "num_preemptions",
    "prefix_hit_tokens",
)


def to_json_value(x: Any, decimals: int = DECIMALS) -> Any:
    """Make a value JSON-native: numpy scalars -> Python, floats rounded, NaN/inf -> None (recursively)."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        f = float(x)
        return round(f, decimals) if math.isfinite(f) else None
    if isinstance(x, Mapping):
        return {str(k): to_json_value(v, decimals) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [to_json_value(v, decimals) for v in x]
    if isinstance(x, np.bool_):
        return bool(x)
    raise TypeError(f"to_json_value: cannot make {type(x).__name__} JSON-native")


def latency_stats(values: Sequence[float | None] | np.ndarray) -> dict[str, float | None]:
    """Mean and p50/p90/p99 (numpy's linear percentiles) of the non-None values; all None if there are none."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {**dict.fromkeys(LATENCY_KEYS), "count": 0}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    stats = {"mean": arr.mean(), "p50": p50, "p90": p90, "p99": p99, "count": int(arr.size)}
    return to_json_value(stats)


def steady_throughput(completion_times_s: Sequence[float] | np.ndarray) -> float | None:
    """Completions per second in the steady middle of a run, ignoring warm-up and drain.

    With t10 and t90 the 10th and 90th percentiles of the completion times, this is
    ``count(t10 < t <= t90) / (t90 - t10)``: the half-open window counts one completion per
    inter-completion gap, so completions every 1 s give exactly 1.0. ``None`` when the window
    is empty (fewer than two distinct completion times).
    """
    t = np.asarray(completion_times_s, dtype=np.float64)
    if t.size < 2:
        return None
    t10, t90 = np.percentile(t, [10, 90])
    if t90 <= t10:
        return None
    n_between = int(np.count_nonzero((t > t10) & (t <= t90)))
    return n_between / float(t90 - t10)


def meets_slo(req: Request, ttft_slo_s: float | None, tpot_slo_s: float | None) -> bool:
    """A finished request meets the SLOs given; a request with one output token has no TPOT and passes it."""
    if req.state is not RequestState.FINISHED:
        return False
    if ttft_slo_s is not None:
        ttft = req.ttft_s
        if ttft is None or ttft > ttft_slo_s:
            return False
    if tpot_slo_s is not None:
        tpot = req.tpot_s
        if tpot is not None and tpot > tpot_slo_s:
            return False
    return True


def summarize(
    requests: Iterable[Request],
    *,
    kv_capacity_tokens: int,
    timeline: Timeline | Sequence[Timeline] | None = None,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    prefix_hit_tokens: int | None = None,
    prompt_tokens_total: int | None = None,
    preemptions: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Aggregate metrics of one run.

    Counts: ``completed`` (FINISHED), ``rejected`` (with ``rejected_reasons``), ``aborted`` and
    ``unfinished`` (still waiting or running: the simulator reports these, they should be 0).
    Rates divide by ``makespan_s`` = last completion - first arrival; token rates and latencies
    are over completed requests. ``goodput_rps`` counts completed requests meeting every SLO
    given (equal to ``throughput_rps`` when none is given); ``slo_attainment`` is that count over
    all requests, rejected ones included. ``kv_usage_mean`` is time-weighted over ``timeline``
    (one instance or a list, pooled). ``prefix_hit_rate`` is prefix-hit tokens / prompt tokens
    over admissions; unless given, the denominator counts each admitted request's prompt once
    per admission (1 + preemptions). ``extra`` adds keys; it may not overwrite computed ones.
    """
    reqs = list(requests)
    _check_summary_inputs(kv_capacity_tokens, ttft_slo_s, tpot_slo_s)
    done = [r for r in reqs if r.state is RequestState.FINISHED]
    finish_times = np.array([r.finish_s for r in done], dtype=np.float64)
    makespan = None
    if done:
        makespan = float(finish_times.max()) - min(r.arrival_s for r in reqs)

    def rate(count: float) -> float:
        return count / makespan if makespan else 0.0

    in_tokens = sum(r.num_prompt_tokens for r in done)
    out_tokens = sum(r.num_output_tokens for r in done)
    slo_given = ttft_slo_s is not None or tpot_slo_s is not None
    good = sum(meets_slo(r, ttft_slo_s, tpot_slo_s) for r in done) if slo_given else len(done)
    prefix_hit_tokens, prompt_tokens_total, preemptions = _admission_totals(
        reqs, prefix_hit_tokens, prompt_tokens_total, preemptions
    )
    kv_usage = None
    if timeline is not None:
        kv_usage = kv_usage_mean([timeline] if isinstance(timeline, Timeline) else list(timeline))

    summary: dict[str, Any] = {
        **_outcome_counts(reqs, done),
        "makespan_s": makespan,
        "throughput_rps": rate(len(done)),
        "steady_throughput_rps": steady_throughput(finish_times),
        "input_tokens_per_s": rate(in_tokens),
        "output_tokens_per_s": rate(out_tokens),
        "total_tokens_per_s": rate(in_tokens + out_tokens),
        "ttft_s": latency_stats([r.ttft_s for r in done]),
        "tpot_s": latency_stats([r.tpot_s for r in done]),
        "e2e_s": latency_stats([r.e2e_s for r in done]),
        "queue_delay_s": latency_stats([r.queue_delay_s for r in done]),
        "ttft_slo_s": ttft_slo_s,
        "tpot_slo_s": tpot_slo_s,
        "goodput_rps": rate(good),
        "slo_attainment": good / len(reqs) if reqs else None,
        "kv_capacity_tokens": int(kv_capacity_tokens),
        "kv_usage_mean": kv_usage,
        "prefix_hit_tokens": int(prefix_hit_tokens),
        "prefix_hit_rate": prefix_hit_tokens / prompt_tokens_total if prompt_tokens_total else None,
        "preemptions": int(preemptions),
    }
    if extra:
        clash = sorted(set(extra) & set(summary))
        if clash:
            raise ValueError(f"extra: keys {clash} would overwrite computed metrics")
        summary.update(extra)
    return to_json_value(summary)


def _check_summary_inputs(
    kv_capacity_tokens: int, ttft_slo_s: float | None, tpot_slo_s: float | None
) -> None:
    if kv_capacity_tokens < 0:
        raise ValueError(f"kv_capacity_tokens: must be >= 0, got {kv_capacity_tokens}")
    for name, slo in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s)):
        if slo is not None and slo <= 0:
            raise ValueError(f"{name}: must be > 0, got {slo}")


def _outcome_counts(reqs: Sequence[Request], done: Sequence[Request]) -> dict[str, Any]:
    """How the requests ended: completed, rejected (by reason), aborted, and unfinished (the rest)."""
    states = Counter(r.state for r in reqs)
    reasons = Counter(r.reject_reason or "unknown" for r in reqs if r.state is RequestState.REJECTED)
    return {
        "num_requests": len(reqs),
        "completed": len(done),
        "rejected": states[RequestState.REJECTED],
        "aborted": states[RequestState.ABORTED],
        "unfinished": len(reqs) - len(done) - states[RequestState.REJECTED] - states[RequestState.ABORTED],
        "rejected_reasons": dict(sorted(reasons.items())),
    }


def _admission_totals(
    reqs: Sequence[Request],
    prefix_hit_tokens: int | None,
    prompt_tokens_total: int | None,
    preemptions: int | None,
) -> tuple[int, int, int]:
    """The given counters, each one not given summed over the requests: prefix-hit tokens, prompt tokens
    over admissions (each admitted prompt once per admission, 1 + preemptions) and preemptions."""
    admitted = [r for r in reqs if r.first_scheduled_s is not None]
    if prefix_hit_tokens is None:
        prefix_hit_tokens = sum(r.prefix_hit_tokens for r in reqs)
    if prompt_tokens_total is None:
        prompt_tokens_total = sum(r.num_prompt_tokens * (1 + r.num_preemptions) for r in admitted)
    if preemptions is None:
        preemptions = sum(r.num_preemptions for r in reqs)
    return prefix_hit_tokens, prompt_tokens_total, preemptions


def request_rows(requests: Iterable[Request]) -> list[dict[str, Any]]:
    """One dict per request with the ``REQUEST_CSV_COLUMNS`` fields (None where undefined)."""
    return [
        {
            "request_id": r.request_id,
            "arrival_s": r.arrival_s,
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_output_tokens": r.num_output_tokens,
            "state": r.state.value,
            "reject_reason": r.reject_reason,
            "queue_delay_s": r.queue_delay_s,
            "ttft_s": r.ttft_s,
            "tpot_s": r.tpot_s,
            "e2e_s": r.e2e_s,
            "num_preemptions": r.num_preemptions,
            "prefix_hit_tokens": r.prefix_hit_tokens,
        }
        for r in requests
    ]


def write_requests_csv(path: str | os.PathLike, requests: Iterable[Request]) -> None:
    """One CSV row per request (columns ``REQUEST_CSV_COLUMNS``; empty cell = undefined, floats unrounded)."""
    from kvbalance.metrics.report import write_table_csv

    write_table_csv(path, request_rows(requests), columns=REQUEST_CSV_COLUMNS)


def write_summary_json(path: str | os.PathLike, summary: Mapping[str, Any]) -> None:
    """Write a summary as JSON with sorted keys and indent 2; NaN/inf become null."""
    with open(path, "w") as f:
        json.dump(to_json_value(summary), f, sort_keys=True, indent=2, allow_nan=False)
        f.write("\n")
