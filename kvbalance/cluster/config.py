"""The ``cluster:`` section of a simulate config, and building and running a cluster from it.

``ClusterConfig`` lists instance groups (role, count, tensor parallelism), the router and its options, the
decode router, the P/D transfer mode, the global KV store and migration. Instances take GPUs in order
(group by group), ``gpus_per_node`` to a node. Every instance runs ``SimulateConfig``'s model, GPU and
batching knobs, with its own ``tp``. ``run_cluster`` serves a request set and returns the pooled summary
plus one row per instance (busy fraction, requests, KV usage) and the hot-spot ratio per role.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvbalance.cluster.adaptive import MigrationSection
from kvbalance.cluster.core import Cluster, ClusterRun, sim_member
from kvbalance.cluster.llumnix import LlumnixSection
from kvbalance.cluster.request_migration import summarize_migrations
from kvbalance.cluster.routers import ROUTERS
from kvbalance.cluster.topology import Topology
from kvbalance.kvcache.store import GlobalKVStore, StoreConfig
from kvbalance.metrics.summary import summarize
from kvbalance.request import Request
from kvbalance.sim.run import SimulateConfig
from kvbalance.specs import get_link, get_model


class InstanceGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["colocated", "prefill", "decode"] = Field(
        "colocated",
        description="what the group's instances run: whole requests, prompts only, or decodes only",
    )
    count: int = Field(1, ge=1, description="instances in the group")
    tp: int = Field(1, ge=1, description="tensor-parallel degree of each instance (GPUs per instance)")


class StoreSection(BaseModel):
    """Global KV store (``kvcache/store.py``); defaults as ``StoreConfig``'s (Mooncake's watermarks)."""

    model_config = ConfigDict(extra="forbid")

    capacity_gb: float = Field(512.0, gt=0, description="host memory of the store, GB")
    link: str = Field("pcie4", description="link between a GPU and the store (kvbalance.specs links)")
    high_watermark: float = Field(0.95, gt=0, le=1, description="occupancy that starts eviction")
    eviction_ratio: float = Field(0.05, gt=0, le=1, description="share of the capacity one eviction frees")
    layerwise_overlap: bool = Field(True, description="fetch and store layer by layer under the compute")

    def to_store_config(self) -> StoreConfig:
        return StoreConfig(
            self.capacity_gb * 1e9,
            self.link,
            self.high_watermark,
            self.eviction_ratio,
            self.layerwise_overlap,
        )


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instances: list[InstanceGroup] = Field(
        default_factory=lambda: [InstanceGroup()], description="groups of instances; GPUs are taken in order"
    )
    gpus_per_node: int = Field(
        8, ge=1, description="GPUs per node (NVLink inside, `inter_node_link` between)"
    )
    inter_node_link: str = Field("net-200g", description="network between nodes (kvbalance.specs links)")
    router: str = Field("least_loaded", description="router of new requests (kvbalance.cluster.routers)")
    router_options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the router")
    decode_router: str = Field("least_loaded", description="P/D: router that picks the decode instance")
    layerwise_transfer: bool = Field(True, description="P/D: send KV layer by layer under the prefill")
    store: StoreSection | None = Field(None, description="the global KV store (off when absent)")
    # BanaServe's adaptive migration (cluster/adaptive.py)
    migration: MigrationSection | None = Field(
        None, description="BanaServe's adaptive migration (off when absent)"
    )
    # Llumnix's request-level live migration (cluster/llumnix.py)
    llumnix: LlumnixSection | None = Field(
        None, description="Llumnix's live request migration (off when absent)"
    )
    policy: str | None = Field(
        None,
        description="every instance's scheduling policy, overriding the simulate config's (e.g. vllm: no chunked prefill)",
    )
    engine: str | None = Field(
        None, description="every instance's engine profile, overriding the simulate config's (e.g. vllm-v0)"
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str | None) -> str | None:
        if v is not None:
            from kvbalance.scheduler import POLICIES

            POLICIES.get(v)
        return v

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str | None) -> str | None:
        if v is not None:
            from kvbalance.perf.engines import get_engine

            get_engine(v)
        return v

    @field_validator("router", "decode_router")
    @classmethod
    def _known_router(cls, v: str) -> str:
        if v not in ROUTERS:
            raise ValueError(f"unknown router {v!r} (known: {', '.join(ROUTERS.names())})")
        return v

    @field_validator("inter_node_link")
    @classmethod
    def _known_link(cls, v: str) -> str:
        get_link(v)
        return v

    @model_validator(mode="after")
    def _pd_pairs(self) -> ClusterConfig:
        roles = {g.role for g in self.instances}
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("instances: prefill instances need decode instances and vice versa")
        if self.llumnix is not None and roles != {"colocated"}:
            raise ValueError("llumnix: live migration runs between colocated instances only")
        return self

    @property
    def num_gpus(self) -> int:
        return sum(g.count * g.tp for g in self.instances)

    def describe(self) -> str:
        return " + ".join(
            f"{g.count}x{g.role[0].upper()}" + (f"(tp{g.tp})" if g.tp > 1 else "") for g in self.instances
        )

    def summary_line(self) -> str:
        """Everything that tells two systems apart, in one line (the results' ``config`` column)."""
        parts = [self.describe(), f"router={self.router}"]
        if self.router_options:
            parts.append(
                "router_options=" + ",".join(f"{k}={v}" for k, v in sorted(self.router_options.items()))
            )
        if self.store is not None:
            parts.append(f"store={self.store.capacity_gb:g}GB/{self.store.link}")
        if self.migration is not None:
            m = self.migration
            kinds = [k for k, on in (("layer+attention", m.moves), ("role flips", m.role_flip)) if on]
            parts.append("migration=" + "+".join(kinds or ["none"]))
        if self.llumnix is not None:
            parts.append("llumnix live migration")
        if self.policy is not None:
            parts.append(f"policy={self.policy}")
        if self.engine is not None:
            parts.append(f"engine={self.engine}")
        return " ".join(parts)


def build_cluster(sim: SimulateConfig, cfg: ClusterConfig, *, check_invariants: bool = False) -> Cluster:
    over = {k: v for k, v in (("policy", cfg.policy), ("engine", cfg.engine)) if v is not None}
    if over:
        sim = sim.model_copy(update=over)
    members = []
    gpu = 0
    cost_models: dict = {}  # members of one model, GPU and TP share a cost model (and its memos)
    for group in cfg.instances:
        for _ in range(group.count):
            gpus = tuple(range(gpu, gpu + group.tp))
            members.append(sim_member(len(members), group.role, gpus, sim, cost_models=cost_models))
            gpu += group.tp
    topo = Topology.build(sim.gpu, gpu, cfg.gpus_per_node, cfg.inter_node_link)
    store = None
    if cfg.store is not None:
        bytes_per_block = sim.block_size * get_model(sim.model).kv_bytes_per_token
        store = GlobalKVStore(cfg.store.to_store_config(), bytes_per_block)
    mig = cfg.migration
    if (
        mig is not None
    ):  # the flip signals are measured against the run's SLOs unless the section sets its own
        mig = mig.model_copy(update={"ttft_slo_s": mig.ttft_slo_s or sim.ttft_slo_s,
                                     "tpot_slo_s": mig.tpot_slo_s or sim.tpot_slo_s})  # fmt: skip
    return Cluster(
        members,
        topo,
        router=cfg.router,
        router_options=cfg.router_options,
        decode_router=cfg.decode_router,
        pd_options={"layerwise_transfer": cfg.layerwise_transfer},
        store=store,
        check_invariants=check_invariants,
        migration=mig,
        llumnix=cfg.llumnix,
    )


@dataclass
class ClusterResult:
    config: SimulateConfig
    cluster_config: ClusterConfig
    cluster: Cluster
    run: ClusterRun
    summary: dict
    instances: list[dict]


def run_cluster(
    sim: SimulateConfig, cfg: ClusterConfig, requests: list[Request], *, check_invariants: bool = False
) -> ClusterResult:
    cluster = build_cluster(sim, cfg, check_invariants=check_invariants)
    run = cluster.run(requests)
    insts = [m.instance for m in cluster.members]
    hot = run.hot_spot_ratio()
    store = cluster.store
    live = summarize_migrations(cluster.llumnix.migrator.log if cluster.llumnix is not None else [])
    rates = cluster.hit_rates()
    scheds = [i.scheduler for i in insts]
    d_hit = cluster.pd.decode_hit_tokens if cluster.pd else 0
    d_adm = cluster.pd.decode_admitted_tokens if cluster.pd else 0
    summary = summarize(
        requests,
        kv_capacity_tokens=sum(i.kv_capacity_tokens for i in insts),
        timeline=run.timelines,
        ttft_slo_s=sim.ttft_slo_s,
        tpot_slo_s=sim.tpot_slo_s,
        preemptions=sum(i.load().num_preemptions for i in insts),
        # hits where prompts are computed (a P/D hand-off's second admission counted apart: Cluster.hit_rates)
        prefix_hit_tokens=sum(s.prefix_hit_tokens for s in scheds) - d_hit,
        prompt_tokens_total=sum(s.admitted_tokens for s in scheds) - d_adm,
        extra={
            "model": sim.model,
            "gpu": sim.gpu,
            "workload": sim.workload,
            "rate": sim.rate if math.isfinite(sim.rate) else "inf",
            "seed": sim.seed,
            "cluster": cfg.describe(),
            "num_gpus": cluster.topology.num_gpus,
            "router": cfg.router,
            "hot_spot_ratio": max(hot.values()) if hot else 1.0,
            "hot_spot_ratio_by_role": hot,
            "store_fetched_blocks": store.fetched_blocks if store else 0,
            "store_saved_blocks": store.saved_blocks if store else 0,
            "store_hit_rate": rates["store_hit_rate"],
            "decode_local_hit_rate": rates["decode_local_hit_rate"],
            "role_flips": len(cluster.role_log),
            "role_log": list(cluster.role_log),
            "controller_trace": cluster.migration.trace_dict() if cluster.migration is not None else None,
            "pd_transfers": len(cluster.pd.handoffs) if cluster.pd else 0,
            "migrations": len(run.migrations) + live["request_migrations"],  # moves of either kind
            "migration_log": run.migrations,
            **(
                cluster.migration.drain.summary()
                if cluster.migration is not None and cluster.migration.drain is not None
                else {}
            ),  # fmt: skip
            "num_steps": sum(i.num_steps for i in insts),
            **live,
        },
    )
    return ClusterResult(sim, cfg, cluster, run, summary, run.instance_rows())
