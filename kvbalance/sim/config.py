"""The typed config of a simulated run (``kvbalance simulate``; YAML keys = field names).

Every setting is declared here once: the CLI's flags (``commands/_config_flags.py``) and the configuration
reference in the docs (``docs/configuration.md``) are derived from these fields. The validators import the
registries they check lazily, so that building the CLI's parser stays cheap.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SimulateConfig(BaseModel):
    """Everything a simulated run depends on. Unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("llama-2-7b", description="model preset (kvbalance.specs)")
    gpu: str = Field("a100-80gb", description="GPU preset, or a preset file from `calibrate` / `profile`")
    engine: str | None = Field(
        None,
        description="serving engine whose host time the steps pay (kvbalance.perf.engines: vllm-v1, sglang, "
        "vllm-v0, kvbalance, hardware, or a profile file); default: vllm-v1 on a GPU preset",
    )
    tp: int = Field(1, ge=1, description="tensor-parallel degree")
    workload: str = Field(
        "sharegpt", description="workload preset, `uniform:A-B:C-D`, `fixed:S:O`, or a trace"
    )
    rate: float = Field(8.0, description="requests/s; inf = every request at time 0")
    num_requests: int | None = Field(1000, ge=1, description="requests to generate (a trace: the first N)")
    arrival: Literal["poisson", "gamma", "constant"] = Field("poisson", description="inter-arrival process")
    cv: float = Field(1.0, gt=0, description="coefficient of variation of gamma arrivals")
    policy: str = Field("sarathi", description="scheduling policy (kvbalance.scheduler.POLICIES)")
    chunk_size: int = Field(
        512, ge=1, description="sarathi: token budget per step; vllm: ignored (whole prompts)"
    )
    max_num_seqs: int = Field(256, ge=1, description="most sequences in one batch")
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    kv_tokens: int | None = Field(None, ge=1, description="KV capacity in tokens (overrides GPU memory)")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="share of GPU memory for weights, activations and KV"
    )
    enable_prefix_caching: bool = Field(True, description="reuse KV of shared prompt prefixes")
    prefix_caching_hash_algo: Literal["sha256", "blake2b", "poly64"] = Field(
        "sha256",
        description="how prefix-cache blocks are named (kvcache.hashing): poly64 is the fast, not collision "
        "resistant hash, for simulations that only count hits (same results; on a Mooncake run the CPU saved is within noise)",
    )
    max_context: int | None = Field(None, ge=1, description="longest prompt + output (default: the model's)")
    seed: int = Field(0, description="seed of the workload and arrivals")
    ttft_slo_s: float | None = Field(None, gt=0, description="time-to-first-token SLO, for goodput")
    tpot_slo_s: float | None = Field(None, gt=0, description="time-per-output-token SLO, for goodput")
    time_scale: float = Field(1.0, gt=0, description="multiplies trace arrival times")
    # elastic KV reserve (kvcache/elastic.py): "elastic" lends the prefill activation reserve to the KV pool
    # during decode-only periods; "static" keeps it in the pool for good (fails with "oom" when a prefill
    # no longer fits); "off" (default) leaves the reserve out of the pool
    elastic: Literal["off", "elastic", "static"] = Field(
        "off",
        description="elastic KV reserve: lend the prefill activation reserve during decode-only periods "
        "(elastic), keep it in the pool for good (static), or leave it out (off)",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from kvbalance.scheduler import POLICIES

        POLICIES.get(v)
        return v

    @field_validator("rate")
    @classmethod
    def _rate_positive(cls, v: float) -> float:
        if not (v > 0):
            raise ValueError("must be > 0 (or inf)")
        return v

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        from kvbalance.specs import get_model

        get_model(v)
        return v

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        from kvbalance.specs import get_gpu

        get_gpu(v)
        return v

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str | None) -> str | None:
        if v is not None:
            from kvbalance.perf.engines import get_engine

            get_engine(v)
        return v


def config_error_message(err) -> str:
    """One line naming the field(s) of a pydantic ValidationError."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)
