"""Readers for measured GPU profiles (the training data of ``kvbalance calibrate``): Vidur's per-operator CUDA
times, NCCL all-reduce times and vLLM's host time per step, as typed samples in seconds and bytes.

Layout (``../shared/profiles`` beside the repository, or ``$KVBALANCE_PROFILES``)::

    vidur/compute/<gpu>/<org>/<model>/mlp.csv         time_stats.<op>.{median,min,max,std} (ms) over the
                                                      repeats, by num_tokens, TP degree
    vidur/network/<topology>/all_reduce.csv           time_stats.all_reduce.median (ms) by size (bytes), workers
    vidur/cpu_overheads/<gpu>/cpu_overheads.csv       <part>_median (ms) by model, batch_size, TP degree
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

from kvbalance.specs import ModelSpec

# Vidur operator -> the cost model's operator (kvbalance.perf.cost.OP_NAMES) it is evaluated as.
VIDUR_OPS = {
    "emb": "embedding",
    "input_layernorm": "norm",
    "post_attention_layernorm": "norm",
    "attn_pre_proj": "qkv_proj",
    "attn_rope": "rope",
    "attn_post_proj": "o_proj",
    "mlp_up_proj": "mlp_up",
    "mlp_act": "activation",
    "mlp_down_proj": "mlp_down",
    "add": "residual_add",
}
# Host-side parts of one vLLM step that run serially with the GPU (``_launch`` columns are parts of ``_e2e``;
# model_execution_e2e waits on the GPU, so it is not host time).
HOST_PARTS = ("schedule", "sampler_e2e", "prepare_inputs_e2e", "process_model_outputs")


def default_profiles_dir() -> Path:
    """``$KVBALANCE_PROFILES``, else ``shared/profiles`` beside the repository."""
    env = os.environ.get("KVBALANCE_PROFILES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "profiles"


@dataclass(frozen=True)
class ProfileShape:
    """The decoder shape a compute profile was measured on (its CSV columns)."""

    model: str
    num_heads: int
    num_kv_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool

    def model_spec(self) -> ModelSpec:
        """A ModelSpec with this shape (gated MLP -> llama architecture, else the two-matrix MLP)."""
        return ModelSpec(
            name=self.model,
            num_layers=1,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            max_context=4096,
            arch="llama" if self.gated_mlp else "opt",
        )


@dataclass(frozen=True)
class OperatorSample:
    """One operator's measured median CUDA time for ``num_tokens`` tokens at TP degree ``tp``, and the repeats'
    fastest, slowest and standard deviation where the profile has them (``None`` otherwise)."""

    gpu: str
    shape: ProfileShape
    op: str  # the cost model's operator name (VIDUR_OPS value)
    profile_op: str  # the profile's own name (VIDUR_OPS key)
    num_tokens: int
    tp: int
    time_s: float
    min_s: float | None = None
    max_s: float | None = None
    std_s: float | None = None


@dataclass(frozen=True)
class HostSample:
    """vLLM's host time of one decode step with ``batch_size`` sequences (sum of ``HOST_PARTS``)."""

    model: str
    batch_size: int
    tp: int
    time_s: float


@dataclass(frozen=True)
class AllReduceSample:
    """One NCCL all-reduce of ``size_bytes`` among ``num_workers`` GPUs."""

    topology: str
    num_workers: int
    size_bytes: int
    time_s: float


def _int(row: dict, col: str, path: Path) -> int:
    try:
        return int(float(row[col]))
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"{col}: missing or not a number in {path}") from None


def _ms(row: dict, col: str, path: Path, positive: bool = True) -> float | None:
    v = row.get(col)
    if v in (None, ""):
        return None
    try:
        t = float(v) * 1e-3
    except ValueError:
        raise ValueError(f"{col}: not a number ({v!r}) in {path}") from None
    if not (t > 0 if positive else t >= 0):
        raise ValueError(f"{col}: times must be {'>' if positive else '>='} 0 ms, got {v!r} in {path}")
    return t


def _operator_sample(
    row: dict, path: Path, gpu: str, shape: ProfileShape, prof_op: str, tokens: int, tp: int
) -> OperatorSample | None:
    """The sample of ``prof_op`` in one row (None where the row has no median for it); the repeats' min and
    max must bracket the median."""
    col = f"time_stats.{prof_op}"
    t = _ms(row, f"{col}.median", path)
    if t is None:
        return None
    lo, hi = _ms(row, f"{col}.min", path), _ms(row, f"{col}.max", path)
    if lo is not None and lo > t:
        raise ValueError(f"{col}.min: {row[col + '.min']!r} ms exceeds the median in {path}")
    if hi is not None and hi < t:
        raise ValueError(f"{col}.max: {row[col + '.max']!r} ms is below the median in {path}")
    std = _ms(row, f"{col}.std", path, positive=False)
    return OperatorSample(gpu, shape, VIDUR_OPS[prof_op], prof_op, tokens, tp, t, lo, hi, std)


def gpu_dirs(root: str | os.PathLike) -> list[str]:
    """GPUs with compute profiles under ``root``."""
    base = Path(root) / "vidur" / "compute"
    return sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []


def load_operator_samples(root: str | os.PathLike, gpu: str) -> list[OperatorSample]:
    """Every operator sample of ``gpu`` (the compute folder's name, e.g. ``h100``, ``a40``)."""
    base = Path(root) / "vidur" / "compute" / gpu
    files = sorted(base.glob("*/*/mlp.csv"))
    if not files:
        known = ", ".join(gpu_dirs(root)) or "none"
        raise ValueError(f"profiles: no compute profiles for gpu {gpu!r} under {base} (found: {known})")
    out: list[OperatorSample] = []
    for path in files:
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                shape = ProfileShape(
                    model=path.parent.name,
                    num_heads=_int(row, "n_head", path),
                    num_kv_heads=_int(row, "n_kv_head", path),
                    hidden_size=_int(row, "n_embd", path),
                    intermediate_size=_int(row, "n_expanded_embd", path),
                    vocab_size=_int(row, "vocab_size", path),
                    gated_mlp=str(row.get("use_gated_mlp", "")).strip().lower() == "true",
                )
                tokens = _int(row, "num_tokens", path)
                tp = _int(row, "num_tensor_parallel_workers", path)
                for prof_op in VIDUR_OPS:
                    sample = _operator_sample(row, path, gpu, shape, prof_op, tokens, tp)
                    if sample is not None:
                        out.append(sample)
    return out


def load_host_samples(
    root: str | os.PathLike, gpu: str = "a40", parts: tuple[str, ...] = HOST_PARTS
) -> list[HostSample]:
    """vLLM host time per step (the medians of ``parts``, by default ``HOST_PARTS``, summed) by model, batch
    size and TP degree. ``parts`` picks a subset, e.g. the parts an engine still runs serially."""
    unknown = sorted(set(parts) - set(HOST_PARTS))
    if unknown or not parts:
        raise ValueError(f"parts: must be a non-empty subset of {', '.join(HOST_PARTS)}, got {parts!r}")
    path = Path(root) / "vidur" / "cpu_overheads" / gpu / "cpu_overheads.csv"
    if not path.is_file():
        raise ValueError(f"profiles: no host-overhead profile at {path}")
    out = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            times = [_ms(row, f"{p}_median", path) for p in parts]
            if any(t is None for t in times):
                raise ValueError(f"{parts}: a part is missing in a row of {path}")
            b, tp = _int(row, "batch_size", path), _int(row, "tensor_parallel_degree", path)
            out.append(HostSample(row.get("model_name", ""), b, tp, float(sum(times))))
    return out


def load_allreduce_samples(root: str | os.PathLike, topology: str = "h100_dgx") -> list[AllReduceSample]:
    """NCCL all-reduce medians of one topology folder (``h100_dgx``: one 8-GPU NVLink/NVSwitch node)."""
    path = Path(root) / "vidur" / "network" / topology / "all_reduce.csv"
    if not path.is_file():
        raise ValueError(f"profiles: no all-reduce profile at {path}")
    out = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            t = _ms(row, "time_stats.all_reduce.median", path)
            if t is not None:
                n, size = _int(row, "num_workers", path), _int(row, "size", path)
                out.append(AllReduceSample(topology, n, size, t))
    return out
