"""Serving metrics in the Prometheus text format, through ``prometheus-client`` (one registry per app).

``ServerMetrics`` holds counters and latency histograms fed by the engine loop and the HTTP layer (429s
count as ``requests_total{finish_reason="overloaded"}``), plus a collector that mirrors the engine's latest
``InstanceLoad`` snapshot (running / waiting requests, KV usage, prefix hits, prefix-cache hits refused for
differing tokens, preemptions, steps) taken
after every step. ``render()`` is ``generate_latest``.
"""

from __future__ import annotations

import math
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.parser import text_string_to_metric_families

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes
PREFIX = "kvbalance_"

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

GAUGES = {
    "num_requests_running": "Requests holding KV blocks and being computed.",
    "num_requests_waiting": "Requests queued for admission (new or preempted).",
    "kv_used_tokens": "KV cache tokens held by running requests.",
    "kv_capacity_tokens": "KV cache capacity in tokens.",
    "kv_usage_ratio": "KV cache tokens held by running requests over capacity (0..1).",
    "kv_free_blocks": "KV blocks on the free list (cached-but-idle blocks not included).",
    "prefix_cache_hit_rate": "Prompt tokens served by the prefix cache over prompt tokens admitted.",
}
ENGINE_COUNTERS = {  # mirrored from the engine's snapshot (the engine owns the count)
    "preemptions": "Requests preempted (KV freed, recomputed later).",
    "prefix_hit_tokens": "Prompt tokens served by the prefix cache.",
    "prefix_cache_token_mismatches": "Prefix-cache lookups whose block hash matched but whose cached tokens "
    "differed from the request's (refused: a miss).",
    "engine_steps": "Engine steps executed.",
}


class _EngineCollector:
    """Exposes the latest engine snapshot as gauges and counters (the custom-collector pattern)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gauges: dict[str, float] = dict.fromkeys(GAUGES, 0.0)
        self.counters: dict[str, float] = dict.fromkeys(ENGINE_COUNTERS, 0.0)

    def collect(self):
        with self.lock:
            gauges, counters = dict(self.gauges), dict(self.counters)
        for name, help_text in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, help_text, value=gauges[name])
        for name, help_text in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, help_text, value=counters[name])


class ServerMetrics:
    """Thread-safe metric store: the engine thread and the HTTP layer write, ``/metrics`` renders."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "Requests that ended, by finish reason (stop, length, abort, rejected, overloaded, error, shutdown).",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of accepted requests.", registry=r
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens generated.", registry=r)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first.",
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the last output token.",
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self._engine = _EngineCollector()
        r.register(self._engine)

    # -- writers -------------------------------------------------------------------
    def set_engine_state(self, load, block_size: int) -> None:
        """Mirror an ``InstanceLoad`` snapshot into the gauges and the engine-owned counters."""
        free_tokens = load.kv_capacity_tokens - load.kv_used_tokens - load.kv_cached_tokens
        with self._engine.lock:
            self._engine.gauges.update(
                num_requests_running=load.num_running,
                num_requests_waiting=load.num_waiting,
                kv_used_tokens=load.kv_used_tokens,
                kv_capacity_tokens=load.kv_capacity_tokens,
                kv_usage_ratio=load.kv_utilization,
                kv_free_blocks=free_tokens // block_size,
                prefix_cache_hit_rate=load.prefix_hit_tokens / load.admitted_tokens
                if load.admitted_tokens
                else 0.0,
            )
            self._engine.counters.update(
                preemptions=load.num_preemptions,
                prefix_hit_tokens=load.prefix_hit_tokens,
                prefix_cache_token_mismatches=getattr(load, "prefix_token_mismatches", 0),
                engine_steps=load.num_steps,
            )

    def add_tokens(self, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)

    def request_done(
        self,
        reason: str,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        e2e_s: float | None = None,
    ) -> None:
        self.requests.labels(finish_reason=reason).inc()
        for hist, v in ((self.ttft, ttft_s), (self.tpot, tpot_s), (self.e2e, e2e_s)):
            if v is not None and math.isfinite(v):
                hist.observe(v)

    # -- reader --------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Samples -> {name{labels}: value}, labels sorted (``kvbalance_requests_total{finish_reason="length"}``)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out
