"""Serving metrics in the Prometheus text exposition format, written by hand (no client library needed).

``ServerMetrics`` holds counters and latency histograms fed by the engine loop, plus a snapshot of the
engine's gauges (running / waiting requests, KV usage, prefix hits) taken after every step; ``render()``
writes them all as ``text/plain; version=0.0.4``.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "kvbalance_"

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _fmt(x: float) -> str:
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return str(int(x))
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if math.isnan(x):
        return "NaN"
    return repr(float(x))


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` upper bounds, plus ``+Inf``, sum, count)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or any(b <= 0 for b in bounds):
            raise ValueError(f"buckets: must be a non-empty list of positive bounds, got {list(buckets)}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{_fmt(bound)}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_fmt(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


class ServerMetrics:
    """Thread-safe metric store: the engine thread writes, the HTTP handler renders."""

    GAUGES = {
        "num_requests_running": "Requests holding KV blocks and being computed.",
        "num_requests_waiting": "Requests queued for admission (new or preempted).",
        "kv_used_tokens": "KV cache tokens held by running requests.",
        "kv_capacity_tokens": "KV cache capacity in tokens.",
        "kv_usage_ratio": "KV cache tokens held by running requests over capacity (0..1).",
        "kv_free_blocks": "KV blocks on the free list (cached-but-idle blocks not included).",
        "prefix_cache_hit_rate": "Prompt tokens served by the prefix cache over prompt tokens admitted.",
    }
    COUNTERS = {
        "requests_total": "Requests that ended, by finish reason (stop, length, abort, rejected, error).",
        "prompt_tokens_total": "Prompt tokens of accepted requests.",
        "generation_tokens_total": "Output tokens generated.",
        "preemptions_total": "Requests preempted (KV freed, recomputed later).",
        "prefix_hit_tokens_total": "Prompt tokens served by the prefix cache.",
        "engine_steps_total": "Engine steps executed.",
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.gauges: dict[str, float] = dict.fromkeys(self.GAUGES, 0.0)
        self.requests_by_reason: dict[str, int] = {}
        self.counters: dict[str, float] = {c: 0 for c in self.COUNTERS if c != "requests_total"}
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.tpot = Histogram(TPOT_BUCKETS_S)
        self.e2e = Histogram(E2E_BUCKETS_S)

    # -- writers (engine thread) ------------------------------------------------
    def set_engine_state(self, gauges: Mapping[str, float], counters: Mapping[str, float]) -> None:
        """Replace the gauges and the engine-owned counters (preemptions, prefix hits, steps) at once."""
        with self._lock:
            self.gauges.update(gauges)
            self.counters.update(counters)

    def add_tokens(self, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        with self._lock:
            self.counters["prompt_tokens_total"] += prompt_tokens
            self.counters["generation_tokens_total"] += generation_tokens

    def request_done(
        self,
        reason: str,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        e2e_s: float | None = None,
    ) -> None:
        with self._lock:
            self.requests_by_reason[reason] = self.requests_by_reason.get(reason, 0) + 1
            for hist, v in ((self.ttft, ttft_s), (self.tpot, tpot_s), (self.e2e, e2e_s)):
                if v is not None and math.isfinite(v):
                    hist.observe(v)

    # -- reader --------------------------------------------------------------------
    def render(self) -> str:
        with self._lock:
            lines: list[str] = []
            for name, help_text in self.GAUGES.items():
                full = PREFIX + name
                lines += [
                    f"# HELP {full} {help_text}",
                    f"# TYPE {full} gauge",
                    f"{full} {_fmt(self.gauges[name])}",
                ]
            for name, help_text in self.COUNTERS.items():
                full = PREFIX + name
                lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter"]
                if name == "requests_total":
                    for reason, n in sorted(self.requests_by_reason.items()):
                        lines.append(f'{full}{{finish_reason="{reason}"}} {n}')
                else:
                    lines.append(f"{full} {_fmt(self.counters[name])}")
            for name, help_text, hist in (
                ("time_to_first_token_seconds", "Time from arrival to the first output token.", self.ttft),
                ("time_per_output_token_seconds", "Mean time per output token after the first.", self.tpot),
                ("e2e_request_latency_seconds", "Time from arrival to the last output token.", self.e2e),
            ):
                full = PREFIX + name
                lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram", *hist.lines(full)]
        return "\n".join(lines) + "\n"


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Sample lines -> {name{labels}: value} (enough to read our own and similar exports back)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out
