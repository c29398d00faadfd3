"""The ``cluster:`` section of ``kvbalance serve --cluster CLUSTER.yaml``: the simulator's schema plus cores.

``ServeClusterConfig`` is ``cluster.config.ClusterConfig`` (groups of colocated / prefill / decode instances,
router and its options, decode router, ``store:``, ``llumnix:``) with each group's ``cpu_cores`` (one core set
per instance, e.g. ``["0", "1"]``: the instance's actor declares that many CPUs to Ray and its engine binds to
them) and ``num_gpus`` per instance. What a real cluster cannot do is refused naming the field: ``tp`` > 1
(one engine per actor here), BanaServe's layer / attention ``migration:`` across processes (see
``docs/cluster_real.md``: one Ray round trip per layer per step), ``layerwise_transfer`` (the real hand-off
is one object after the prefill's last step) and a simulated ``engine`` profile; ``policy`` (the
scheduling policy) goes to every instance's engine. The top-level keys beside ``cluster:``
are the engine's (``EngineArgs``: model, KV tokens, chunk size, ...), the same for every instance.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvbalance.cluster.config import ClusterConfig, InstanceGroup
from kvbalance.sim.run import config_error_message

DTYPES = ("auto", "float32", "bfloat16", "float16")


class ServeInstanceGroup(InstanceGroup):
    """One group of a real cluster: ``count`` instances of ``role``, each an actor on its own cores."""

    cpu_cores: list[str] | None = None  # one core set per instance ("0", "2-3"); None: unbound, 1 CPU each
    num_gpus: float = Field(0.0, ge=0)  # per instance (CUDA engines)

    @field_validator("cpu_cores", mode="before")
    @classmethod
    def _as_strings(cls, v):
        if isinstance(v, list):
            return [str(c) for c in v]
        return v

    @model_validator(mode="after")
    def _real(self) -> ServeInstanceGroup:
        if self.tp != 1:
            raise ValueError(f"tp: the real cluster runs one engine per actor (tp 1), got {self.tp}")
        if self.cpu_cores is not None and len(self.cpu_cores) != self.count:
            raise ValueError(
                f"cpu_cores: one core set per instance ({self.count}), got {len(self.cpu_cores)}: {self.cpu_cores}"
            )
        return self

    def cores_of(self, k: int) -> str | None:
        return None if self.cpu_cores is None else self.cpu_cores[k]


class ServeClusterConfig(ClusterConfig):
    instances: list[ServeInstanceGroup] = Field(default_factory=lambda: [ServeInstanceGroup()])
    layerwise_transfer: bool = False  # the real hand-off moves the KV after the prefill's last step

    @model_validator(mode="after")
    def _serveable(self) -> ServeClusterConfig:
        if self.layerwise_transfer:
            raise ValueError(
                "layerwise_transfer: the real cluster hands a prompt's KV over after the prefill's last step "
                "(one object per request; docs/cluster_real.md), not layer by layer"
            )
        if self.engine is not None:
            raise ValueError(
                "engine: a simulated engine's host-time profile; a real cluster runs its own engine"
            )
        if self.migration is not None:
            raise ValueError(
                "migration: BanaServe's layer- and attention-level migration moves part of every step to "
                "another GPU; across Ray actors that is a round trip per step (layer) or per layer (attention), "
                "not built for real serving (docs/cluster_real.md); use llumnix: for live request migration"
            )
        return self

    def instance_plan(self) -> list[tuple[str, str, str | None, float]]:
        """(name, role, cpu_cores, num_gpus) per instance, group by group."""
        out, seen = [], {"colocated": 0, "prefill": 0, "decode": 0}
        for g in self.instances:
            for k in range(g.count):
                out.append((f"{g.role}-{seen[g.role]}", g.role, g.cores_of(k), g.num_gpus))
                seen[g.role] += 1
        return out


class EngineArgs(BaseModel):
    """What every instance's ``LLMEngine`` is built with (``kvbalance serve``'s engine flags)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "smollm2-135m"
    kv_tokens: int = Field(65_536, ge=1)
    block_size: int | None = Field(None, ge=1)
    chunk_size: int = Field(2048, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    max_model_len: int | None = Field(None, ge=1)
    threads: int | None = Field(None, ge=1)  # per instance; default: one per core of its cpu_cores
    prefix_caching_hash_algo: str | None = None  # LLMEngine's defaults when None
    prefix_caching_salt: str | None = None

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPES:
            raise ValueError(f"must be one of {', '.join(DTYPES)}, got {v!r}")
        return v

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            "kv_cache_tokens": self.kv_tokens,
            "block_size": self.block_size,
            "max_num_batched_tokens": self.chunk_size,
            "max_num_seqs": self.max_num_seqs,
            "dtype": self.dtype,
            "device": self.device,
            "seed": self.seed,
            "max_model_len": self.max_model_len,
            "prefix_caching_hash_algo": self.prefix_caching_hash_algo,
            "prefix_caching_salt": self.prefix_caching_salt,
        }


def parse_cluster_file(
    data: dict, defaults: dict[str, Any] | None = None
) -> tuple[EngineArgs, ServeClusterConfig]:
    """A loaded CLUSTER.yaml -> (engine args, cluster config); errors name the field (``cluster.router: ...``).

    Top-level engine keys override ``defaults`` (the command line's values)."""
    if not isinstance(data, dict):
        raise ValueError("config: a cluster file holds a mapping with a cluster: section")
    data = dict(data)
    section = data.pop("cluster", None)
    if section is None:
        raise ValueError("cluster: the file has no cluster: section (instances, router, store, llumnix)")
    if not isinstance(section, dict):
        raise ValueError("cluster: must be a mapping (instances, router, store, llumnix)")
    try:
        engine = EngineArgs(**{**(defaults or {}), **data})
    except ValidationError as e:
        raise ValueError(config_error_message(e)) from None
    try:
        cfg = ServeClusterConfig(**section)
    except ValidationError as e:
        raise ValueError("cluster." + config_error_message(e)) from None
    return engine, cfg
