"""Engine profiles: the host time a serving engine spends around each GPU step, and how much of it the GPU
hides. The kernels of a step cost the same whichever engine launches them (:class:`~kvbalance.perf.cost.
CostModel`); the scheduling, input preparation, sampling bookkeeping, output processing and kernel launches
around them are the engine's, and so is whether they run between GPU steps or during them.

With ``gpu`` the step's GPU time (kernels and all-reduces), ``host`` the engine's host work per step, ``launch``
the host time to launch the step's kernels and ``sync`` the part that no engine overlaps (the sampled tokens'
device-to-host copy it waits on, the first kernel of a step):

    serial (vLLM v0):                                  step = host + max(gpu, launch) + sync
    overlapped (vLLM v1 async scheduling, SGLang's     step = max(max(gpu, launch), host) + sync
    overlap scheduler: host work of step k + 1 runs
    while the GPU runs step k)

Launches are asynchronous, so they overlap with the kernels already queued: a step is launch-bound only when
launching its kernels takes longer than running them. ``launch`` is one CUDA-graph replay
(``graph_launch_s``) for a step the engine captured (a decode-only batch of at most ``cuda_graph_max_seqs``
sequences, or any step of at most ``cuda_graph_max_tokens`` tokens), else ``eager_launch_per_kernel_s`` per
kernel. So a step is never shorter than its GPU time, and an overlapped step never longer than the same
engine's serial step.

Profiles are data (``perf/engines/*.yaml``): every parameter is a ``{value, source}`` pair naming the
measurement, paper or engine documentation it comes from. ``vllm-v0`` and ``hardware`` take the host time the
hardware spec was fitted with (``HardwareSpec.host_overhead_s``) and pay it serially: exactly the step times of
the cost model before engine profiles existed.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbalance.specs import HardwareSpec

ENGINES_DIR = Path(__file__).resolve().parent / "engines"
DEFAULT_ENGINE = "vllm-v1"  # a GPU preset's default: a current engine
CPU_DEFAULT_ENGINE = "hardware"  # a CPU spec (kvbalance profile) was fitted on the real engine's own steps

_BOOL_FIELDS = ("host_from_hardware", "overlap")
_INT_FIELDS = ("cuda_graph_max_seqs", "cuda_graph_max_tokens", "custom_allreduce_max_bytes")
_TIME_FIELDS = (
    "host_fixed_s",
    "host_per_seq_s",
    "host_per_token_s",
    "host_tp_fixed_s",
    "host_tp_per_seq_s",
    "host_per_tp_rank_s",
    "sync_s",
    "graph_launch_s",
    "eager_launch_per_kernel_s",
    "custom_allreduce_latency_s",
)
_RATE_FIELDS = ("custom_allreduce_bandwidth_bytes_s",)
PARAMS = _BOOL_FIELDS + _TIME_FIELDS + _INT_FIELDS + _RATE_FIELDS  # each needs a value and a source in a file


@dataclass(frozen=True)
class EngineProfile:
    """How one serving engine (and version) pays host time per step; see the module docstring.

    ``host_from_hardware``: the host work is the hardware spec's fitted ``host_overhead_s`` (and its
    per-layer gaps), and the ``host_*`` fields here are unused. Otherwise the host work of a step over ``seqs``
    sequences and ``tokens`` tokens is ``host_fixed_s + host_per_seq_s * seqs + host_per_token_s * tokens``,
    plus, when tp > 1, ``host_tp_fixed_s + host_tp_per_seq_s * seqs + host_per_tp_rank_s * (tp - 1)``.
    ``sources`` names where each parameter comes from."""

    name: str
    engine: str  # the engine and version the profile stands for
    host_from_hardware: bool = False
    overlap: bool = False
    host_fixed_s: float = 0.0
    host_per_seq_s: float = 0.0
    host_per_token_s: float = 0.0
    host_tp_fixed_s: float = 0.0
    host_tp_per_seq_s: float = 0.0
    host_per_tp_rank_s: float = 0.0
    sync_s: float = 0.0
    cuda_graph_max_seqs: int = 0
    cuda_graph_max_tokens: int = 0
    graph_launch_s: float = 0.0
    eager_launch_per_kernel_s: float = 0.0
    custom_allreduce_max_bytes: int = 0
    custom_allreduce_latency_s: float = 0.0
    custom_allreduce_bandwidth_bytes_s: float = 0.0
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"engine.name: must be a non-empty string, got {self.name!r}")
        for f in _BOOL_FIELDS:
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"engine {self.name}: {f}: must be true or false, got {getattr(self, f)!r}")
        for f in _TIME_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ValueError(
                    f"engine {self.name}: {f}: must be a finite number >= 0 (seconds), got {v!r}"
                )
        for f in _INT_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"engine {self.name}: {f}: must be an integer >= 0, got {v!r}")
        for f in _RATE_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ValueError(
                    f"engine {self.name}: {f}: must be a finite number >= 0 (bytes/s), got {v!r}"
                )
        if self.custom_allreduce_max_bytes > 0 and not self.custom_allreduce_bandwidth_bytes_s > 0:
            raise ValueError(
                f"engine {self.name}: custom_allreduce_bandwidth_bytes_s: must be > 0 when "
                f"custom_allreduce_max_bytes > 0"
            )

    @property
    def has_graphs(self) -> bool:
        return self.cuda_graph_max_seqs > 0 or self.cuda_graph_max_tokens > 0

    def uses_graph(self, num_seqs: int, num_tokens: int) -> bool:
        """Whether a step over ``num_seqs`` sequences and ``num_tokens`` tokens replays a captured CUDA graph:
        a decode-only batch (one token per sequence) of at most ``cuda_graph_max_seqs`` sequences, or any step
        of at most ``cuda_graph_max_tokens`` tokens."""
        if num_tokens <= 0:
            return False
        if num_tokens <= self.cuda_graph_max_tokens:
            return True
        return num_tokens == num_seqs and num_seqs <= self.cuda_graph_max_seqs

    def host_work_s(self, hw: HardwareSpec, num_seqs: int, num_tokens: int, tp: int = 1) -> float:
        """The engine's host work for one step (before any overlap)."""
        if self.host_from_hardware:
            return hw.host_overhead_s(num_seqs, num_tokens, tp)
        extra = (
            self.host_tp_fixed_s + self.host_tp_per_seq_s * num_seqs + self.host_per_tp_rank_s * (tp - 1)
            if tp > 1
            else 0.0
        )
        return self.host_fixed_s + extra + self.host_per_seq_s * num_seqs + self.host_per_token_s * num_tokens

    def launch_s(self, num_seqs: int, num_tokens: int, num_kernels: int) -> float:
        """Host time to launch one step's ``num_kernels`` kernels: a graph replay or one launch per kernel."""
        if self.uses_graph(num_seqs, num_tokens):
            return self.graph_launch_s
        return self.eager_launch_per_kernel_s * num_kernels

    def allreduce_s(self, num_bytes: float, tp: int, link_time_s: float, nvlink: bool) -> float:
        """One all-reduce of ``num_bytes`` among ``tp`` GPUs: the link's (NCCL) time ``link_time_s``, or, for a
        message of at most ``custom_allreduce_max_bytes`` over NVLink, the engine's own all-reduce kernel
        (``custom_allreduce_latency_s + 2 (tp - 1) / tp * bytes / custom_allreduce_bandwidth_bytes_s``) where
        that is faster, as vLLM picks its custom all-reduce only for sizes where it wins."""
        if not nvlink or tp <= 1 or num_bytes <= 0 or num_bytes > self.custom_allreduce_max_bytes:
            return link_time_s
        own = (
            self.custom_allreduce_latency_s
            + 2.0 * (tp - 1) / tp * num_bytes / self.custom_allreduce_bandwidth_bytes_s
        )
        return own if own < link_time_s else link_time_s

    def to_dict(self) -> dict[str, Any]:
        """The profile as a profile file holds it: ``{name, engine, description, params: {p: {value, source}}}``."""
        return {
            "name": self.name,
            "engine": self.engine,
            "description": self.description,
            "params": {p: {"value": getattr(self, p), "source": self.sources.get(p, "")} for p in PARAMS},
        }


@dataclass(frozen=True, slots=True)
class HostTime:
    """Where a step's host time went: ``work_s`` (scheduling, inputs, outputs), ``launch_s`` and ``sync_s`` as
    the profile charges them; ``exposed_s`` is what they add to the GPU time (``step_s - gpu_s``), ``hidden_s``
    what overlap hid (the serial sum ``work_s + launch_s + sync_s`` less ``exposed_s``)."""

    engine: str
    gpu_s: float
    work_s: float
    launch_s: float
    sync_s: float
    step_s: float
    graph: bool

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.gpu_s

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.work_s + self.launch_s + self.sync_s - self.exposed_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "gpu_s": self.gpu_s,
            "host_work_s": self.work_s,
            "launch_s": self.launch_s,
            "sync_s": self.sync_s,
            "host_exposed_s": self.exposed_s,
            "host_hidden_s": self.hidden_s,
            "cuda_graph": self.graph,
            "step_s": self.step_s,
        }


def step_time_s(engine: EngineProfile, gpu_s: float, work_s: float, launch_s: float) -> float:
    """A step's duration from its GPU time and the engine's host work and launch time (module docstring)."""
    busy = gpu_s if gpu_s >= launch_s else launch_s
    if engine.overlap:
        return (busy if busy >= work_s else work_s) + engine.sync_s
    return work_s + busy + engine.sync_s


def host_time(
    engine: EngineProfile,
    hw: HardwareSpec,
    gpu_s: float,
    num_seqs: int,
    num_tokens: int,
    num_kernels: int,
    tp: int = 1,
) -> HostTime:
    """The :class:`HostTime` of a step of ``gpu_s`` GPU seconds over ``num_seqs`` sequences, ``num_tokens``
    tokens and ``num_kernels`` kernel launches on ``hw`` with tensor parallelism ``tp``."""
    work = engine.host_work_s(hw, num_seqs, num_tokens, tp)
    launch = engine.launch_s(num_seqs, num_tokens, num_kernels)
    return HostTime(
        engine.name,
        gpu_s,
        work,
        launch,
        engine.sync_s,
        step_time_s(engine, gpu_s, work, launch),
        engine.uses_graph(num_seqs, num_tokens),
    )


# -- profile files ----------------------------------------------------------------------------------------
def engine_from_dict(data: Any, where: str = "engine") -> EngineProfile:
    """An :class:`EngineProfile` from a profile file's mapping; every error names the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - {"name", "engine", "description", "params"})
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)} (known: name, engine, description, params)"
        )
    for key in ("name", "engine", "params"):
        if key not in data:
            raise ValueError(f"{where}: missing {key!r}")
    name = data["name"]
    params = data["params"]
    if not isinstance(params, dict):
        raise ValueError(f"{where}.params: expected a mapping of parameter -> {{value, source}}")
    bad = sorted(set(params) - set(PARAMS))
    if bad:
        raise ValueError(
            f"{where}.params: unknown parameter(s) {', '.join(bad)} (known: {', '.join(PARAMS)})"
        )
    missing = [p for p in PARAMS if p not in params]
    if missing:
        raise ValueError(
            f"{where}.params: missing {', '.join(missing)} (every parameter needs a value and a source)"
        )
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for p in PARAMS:
        entry = params[p]
        if not isinstance(entry, dict) or set(entry) != {"value", "source"}:
            raise ValueError(f"{where}.params.{p}: expected {{value: ..., source: ...}}, got {entry!r}")
        src = entry["source"]
        if not isinstance(src, str) or not src.strip():
            raise ValueError(f"{where}.params.{p}.source: must name where the value comes from")
        values[p] = entry["value"]
        sources[p] = src.strip()
    return EngineProfile(
        name=name,
        engine=str(data["engine"]),
        description=str(data.get("description", "")).strip(),
        sources=sources,
        **values,
    )


def load_engine(path: str | os.PathLike) -> EngineProfile:
    """Read an engine profile file (YAML; the format of ``perf/engines/*.yaml``)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"engine: no such profile file {str(p)!r}")
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"engine: cannot read profile file {str(p)!r} ({e})") from None
    return engine_from_dict(data, f"engine {p.name}")


def _load_presets() -> dict[str, EngineProfile]:
    out = {}
    for path in sorted(ENGINES_DIR.glob("*.yaml")):
        prof = load_engine(path)
        if prof.name != path.stem:
            raise ValueError(f"engine {path.name}: name {prof.name!r} differs from the file name")
        out[prof.name] = prof
    return out


ENGINES: dict[str, EngineProfile] = _load_presets()

_PROFILE_SUFFIXES = (".yaml", ".yml")
_default: contextvars.ContextVar[str | EngineProfile | None] = contextvars.ContextVar(
    "kvbalance_engine", default=None
)


def list_engines() -> list[str]:
    return list(ENGINES)


def get_engine(engine: str | os.PathLike | EngineProfile) -> EngineProfile:
    """A profile by name (case-insensitive), or a profile file (``.yaml``); an EngineProfile passes through."""
    if isinstance(engine, EngineProfile):
        return engine
    if isinstance(engine, os.PathLike) or (
        isinstance(engine, str) and engine.lower().endswith(_PROFILE_SUFFIXES)
    ):
        return load_engine(engine)
    if not isinstance(engine, str):
        raise ValueError(f"engine: expected a profile name, got {type(engine).__name__}")
    key = engine.strip().lower().replace("_", "-")
    if key not in ENGINES:
        raise ValueError(f"engine: unknown {engine!r} (known: {', '.join(ENGINES)})")
    return ENGINES[key]


@contextlib.contextmanager
def default_engine(engine: str | os.PathLike | EngineProfile | None) -> Iterator[None]:
    """Within the block, a cost model built without an ``engine`` uses ``engine`` (None: the usual default):
    how ``reproduce --engine`` reaches the cost models an experiment builds."""
    if engine is not None:
        get_engine(engine)  # a bad name fails here, before the experiment starts
    token = _default.set(engine)
    try:
        yield
    finally:
        _default.reset(token)


def resolve_engine(engine: str | os.PathLike | EngineProfile | None, hw: HardwareSpec) -> EngineProfile:
    """The profile a cost model on ``hw`` uses: ``engine`` if given, else the one set by
    :func:`default_engine`, else ``DEFAULT_ENGINE`` on a GPU and ``CPU_DEFAULT_ENGINE`` on a CPU spec."""
    if engine is None:
        engine = _default.get()
    if engine is None:
        engine = CPU_DEFAULT_ENGINE if hw.kind == "cpu" else DEFAULT_ENGINE
    return get_engine(engine)
