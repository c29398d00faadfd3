"""``/metrics`` for a real cluster: one labelled series per instance, and the router's own counters.

``ClusterCollector`` is a prometheus-client custom collector registered on the server's registry beside its
unlabelled totals (the cluster's summed ``InstanceLoad``). Per instance (labels ``instance``, ``role``):
requests running / waiting / loading KV, KV tokens used and capacity, alive (0 once it died), and the
engine's counters (steps, preemptions, prefix-cache and connector hit tokens). For the router: requests
routed per instance, P/D transfers and their bytes, retries after an instance failure, requests failed,
instance failures, live migrations committed and aborted.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "kvbalance_cluster_"

INSTANCE_GAUGES = {
    "num_requests_running": ("num_running", "Requests running on the instance."),
    "num_requests_waiting": ("num_waiting", "Requests queued on the instance."),
    "num_requests_loading": (
        "num_loading",
        "Requests waiting for their KV to arrive (P/D, store, migration).",
    ),
    "kv_used_tokens": ("kv_used_tokens", "KV tokens held by requests on the instance."),
    "kv_capacity_tokens": ("kv_capacity_tokens", "KV capacity of the instance in tokens."),
}
INSTANCE_COUNTERS = {
    "engine_steps": ("num_steps", "Engine steps the instance ran."),
    "preemptions": ("num_preemptions", "Requests preempted on the instance."),
    "prefix_hit_tokens": ("prefix_hit_tokens", "Prompt tokens served by the instance's prefix cache."),
    "external_hit_tokens": ("external_hit_tokens", "Tokens whose KV was loaded from outside (P/D, store)."),
}
ROUTER_COUNTERS = {
    "pd_transfers": "Prefill-to-decode KV hand-offs.",
    "pd_transfer_bytes": "Bytes of KV handed from prefill to decode instances.",
    "retries": "Requests re-routed after their instance failed before they streamed anything.",
    "failed_requests": "Requests failed because their instance died after they streamed tokens.",
    "instance_failures": "Instances taken out after a failure.",
}


class ClusterCollector:
    def __init__(self, backend) -> None:
        self.backend = backend

    def collect(self):
        b = self.backend
        rows = b.instance_rows()
        labels = ["instance", "role"]
        for name, (attr, help_text) in INSTANCE_GAUGES.items():
            g = GaugeMetricFamily(PREFIX + name, help_text, labels=labels)
            for r in rows:
                g.add_metric([r["instance"], r["role"]], getattr(r["load"], attr))
            yield g
        alive = GaugeMetricFamily(
            PREFIX + "instance_alive", "1 while the instance serves, 0 once it died.", labels=labels
        )
        routed = CounterMetricFamily(
            PREFIX + "routed_requests", "Requests the routers sent to the instance.", labels=labels
        )
        for r in rows:
            alive.add_metric([r["instance"], r["role"]], 1.0 if r["alive"] else 0.0)
            routed.add_metric([r["instance"], r["role"]], r["routed"])
        yield alive
        yield routed
        for name, (attr, help_text) in INSTANCE_COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, help_text, labels=labels)
            for r in rows:
                c.add_metric([r["instance"], r["role"]], getattr(r["load"], attr))
            yield c
        with b.lock:
            counters = dict(b.counters)
        for name, help_text in ROUTER_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, help_text, value=counters[name])
        mig = b.migrations.summary()
        yield CounterMetricFamily(
            PREFIX + "request_migrations",
            "Live request migrations committed.",
            value=mig["request_migrations"],
        )
        aborts = CounterMetricFamily(
            PREFIX + "request_migration_aborts", "Live migrations aborted, by reason.", labels=["reason"]
        )
        for reason, n in mig["request_migration_aborts"].items():
            aborts.add_metric([reason], n)
        yield aborts
