"""``HardwareSpec``: a GPU's peaks and fitted efficiency curves, kernel latency, host overhead, TP link and
measured-shape corrections; saved and loaded as JSON or YAML."""

from __future__ import annotations

import json
import operator
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvbalance.specs.links import LINKS, LinkSpec, get_link

MIB = 1 << 20
_NON_NEGATIVE = (
    "compute_half_tokens",
    "memory_half_bytes",
    "step_overhead_s",
    "per_layer_overhead_s",
    "kernel_latency_s",
    "host_overhead_per_seq_s",
    "host_overhead_per_token_s",
    "host_overhead_tp_s",
    "host_overhead_tp_per_seq_s",
    "host_overhead_per_tp_rank_s",
    "l2_cache_bytes",
    "num_sms",
)


# Element-wise kernel classes with their own fitted memory curve (``HardwareSpec.elementwise_curves``): RMSNorm
# (``norm``) and LayerNorm, SwiGLU (``activation``) and a plain activation (GELU/ReLU) are different kernels.
# The KV-cache write has no profile of its own and follows the rotary curve (the same per-token rows of heads).
ELEMENTWISE_CLASSES = (
    "embedding",
    "norm",
    "layer_norm",
    "rope",
    "activation",
    "activation_ungated",
    "residual_add",
)


@dataclass(frozen=True)
class MemoryCurve:
    """A memory-bound kernel class: ``bytes * max(tokens, sat_tokens) / (tokens * bw * e(bytes)) + latency_s``,
    ``e(bytes) = eff + l2_eff_gain / (1 + (bytes / (l2_bytes_scale * L2)) ** l2_sharpness)`` with
    ``L2 = HardwareSpec.l2_cache_bytes`` (at the defaults 1 and 1: ``eff + l2_eff_gain * L2 / (L2 + bytes)``; a
    larger ``l2_sharpness`` is a cliff where the kernel's tensors stop fitting in L2, as the A40's residual
    add and rotary show).

    ``eff`` is the fraction of peak DRAM bandwidth reached on large tensors, ``l2_eff_gain`` what tensors that
    stay in L2 add to it (negative where the kernel is slower there); below ``sat_tokens`` tokens the kernel
    takes as long as at ``sat_tokens`` (one thread block per token: fewer tokens leave SMs idle);
    ``latency_s`` is the kernel's fixed time.

    At or below ``small_tokens`` tokens the kernel runs another code path (the measured embedding gather does:
    a fixed cost per token row, whatever the row's width, and a step down past 16 tokens):
    ``small_latency_s + small_per_token_s * tokens``. ``small_tokens = 0``: no such path.

    Wave quantisation (one thread block per token row, ``HardwareSpec.num_sms`` rows per wave): the kernel moves
    its bytes as if ``tokens + wave_weight * (waves * num_sms - tokens)`` rows were there, waves =
    ceil(tokens / num_sms); ``wave_weight`` in [0, 1] (0: a smooth curve; the measured SwiGLU steps up by
    nearly a whole wave past each multiple of the SM count).
    """

    eff: float
    sat_tokens: float = 0.0
    latency_s: float = 0.0
    l2_eff_gain: float = 0.0
    small_tokens: float = 0.0
    small_latency_s: float = 0.0
    small_per_token_s: float = 0.0
    wave_weight: float = 0.0
    l2_bytes_scale: float = 1.0
    l2_sharpness: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.eff <= 4.0:
            raise ValueError(f"eff: must be in (0, 4], got {self.eff!r}")
        if not 0 < self.eff + self.l2_eff_gain <= 8.0:
            raise ValueError(f"l2_eff_gain: eff + l2_eff_gain must be in (0, 8], got {self.l2_eff_gain!r}")
        if not self.l2_bytes_scale > 0 or not self.l2_sharpness > 0:
            raise ValueError(
                f"l2_bytes_scale, l2_sharpness: must be > 0, got {self.l2_bytes_scale!r}, {self.l2_sharpness!r}"
            )
        if not 0 <= self.wave_weight <= 1:
            raise ValueError(f"wave_weight: must be in [0, 1], got {self.wave_weight!r}")
        for f in ("sat_tokens", "latency_s", "small_tokens", "small_latency_s", "small_per_token_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f}: must be >= 0, got {getattr(self, f)!r}")


@dataclass(frozen=True)
class ShapeCorrection:
    """Measured-time correction of one profiled kernel shape on one GPU (the second level of the cost model,
    after Vidur's per-operator predictor from profiled points): at ``tokens[i]`` (M, ascending) the measured
    time is ``exp(log_ratio[i])`` times the physical model's; between knots the log ratio is interpolated
    linearly in log M, beyond the ends it holds the end value (``kvbalance.perf.correction``). With
    ``tile_tokens`` > 0 a token count M sees only the knots of its tile bucket ceil(M / tile_tokens) where that
    bucket has any (cuBLAS switches kernels at M tile boundaries); 0 (the default, and every preset written
    before the field): one interpolation over all knots."""

    tokens: tuple[float, ...]
    log_ratio: tuple[float, ...]
    tile_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(float(t) for t in self.tokens))
        object.__setattr__(self, "log_ratio", tuple(float(r) for r in self.log_ratio))
        if not self.tokens or len(self.tokens) != len(self.log_ratio):
            raise ValueError(
                f"tokens, log_ratio: need as many ratios as token counts (>= 1), got "
                f"{len(self.tokens)} and {len(self.log_ratio)}"
            )
        if self.tokens[0] < 1 or any(b <= a for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError("tokens: must be >= 1 and strictly ascending")
        if not all(abs(r) < 20 for r in self.log_ratio):  # also rejects NaN
            raise ValueError("log_ratio: must be finite, |log_ratio| < 20")
        try:  # an integer of any kind (a float is refused: a tile is a whole number of rows)
            tile = operator.index(self.tile_tokens)
        except TypeError:
            tile = -1
        if tile < 0:
            raise ValueError(f"tile_tokens: must be an integer >= 0, got {self.tile_tokens!r}")
        object.__setattr__(self, "tile_tokens", tile)


def _typed_mapping(name: str, raw: Any, item_cls: type) -> dict[str, Any]:
    """``raw`` (a mapping of name -> ``item_cls`` or its fields) as ``item_cls`` values; errors name ``name``."""
    if not isinstance(raw, dict):
        raise ValueError(f"{name}: expected a mapping, got {type(raw).__name__}")
    try:
        return {k: v if isinstance(v, item_cls) else item_cls(**v) for k, v in raw.items()}
    except TypeError as e:
        raise ValueError(f"{name}: {e} (fields: {', '.join(f.name for f in fields(item_cls))})") from None
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or a CPU): peaks, capacity, efficiency curves and fixed overheads.

    Achievable fractions grow with operator size (hyperbolic saturation):
    ``eff_c(tokens) = compute_eff_max * tokens / (tokens + compute_half_tokens)`` for GEMMs (tokens =
    the GEMM's M dimension), ``eff_m(bytes) = memory_eff_max * bytes / (bytes + memory_half_bytes)`` for
    memory traffic. Equivalently an operator costs ``(M + compute_half_tokens)`` tokens of compute and
    ``(bytes + memory_half_bytes)`` bytes of traffic at the saturated rate. Attention kernels reach
    ``attention_eff_ratio`` times the GEMM compute fraction, and read the KV cache at
    ``kv_memory_eff_ratio`` times the streaming bandwidth fraction (1 on GPUs by default; on a CPU the
    paged, scattered KV reads and the weight streams reach very different rates, so it is fitted).

    Fitted GPU presets (``kvbalance calibrate``) add: ``kernel_latency_s``, the fixed time of every GEMM and
    attention kernel; ``elementwise_curves``, a :class:`MemoryCurve` per element-wise class
    (``ELEMENTWISE_CLASSES``; a class left out uses the streaming formula above); and the engine's host time
    per step, ``step_overhead_s + host_overhead_per_seq_s * seqs + host_overhead_per_token_s * tokens``, plus,
    when tensor parallel workers must be synchronised (tp > 1), ``host_overhead_tp_s +
    host_overhead_tp_per_seq_s * seqs + host_overhead_per_tp_rank_s * (tp - 1)`` (broadcasting the step's
    inputs to the workers grows with the batch and with the number of workers).

    ``shape_corrections`` maps a profiled kernel shape (``kvbalance.perf.correction.kernel_key``) to its
    :class:`ShapeCorrection` on this GPU: the simulator reproduces the measured times of profiled shapes
    (cuBLAS kernel switches included) and uses the physical model alone everywhere else. Only the preset
    fitted on this GPU's own measurements carries them (presets that borrow a fit do not). ``fitted_on``
    names the device whose profiles the curves were fitted on (the preset itself, or the GPU it borrows from).
    """

    name: str
    peak_flops: float  # dense fp16/bf16 FLOP/s (no sparsity)
    mem_bandwidth_bytes_s: float
    mem_capacity_bytes: int
    compute_eff_max: float = 0.55
    compute_half_tokens: float = 16.0
    memory_eff_max: float = 0.9
    memory_half_bytes: float = 1.0 * MIB
    attention_eff_ratio: float = 0.8
    kv_memory_eff_ratio: float = 1.0
    step_overhead_s: float = 1.0e-3  # scheduling, sampling, launch of one step (host, fixed part)
    per_layer_overhead_s: float = 8.0e-6  # kernel launch gaps per transformer layer
    kernel_latency_s: float = 0.0  # fixed time of each GEMM / attention kernel
    host_overhead_per_seq_s: float = 0.0  # host time per sequence in the batch (inputs, sampling, outputs)
    host_overhead_per_token_s: float = 0.0  # host time per scheduled token
    host_overhead_tp_s: float = 0.0  # extra host time per step when tp > 1 (worker synchronisation)
    host_overhead_tp_per_seq_s: float = (
        0.0  # extra host time per sequence when tp > 1 (inputs to the workers)
    )
    host_overhead_per_tp_rank_s: float = 0.0  # extra host time per step per worker beyond the first
    elementwise_curves: dict[str, MemoryCurve] = field(default_factory=dict, hash=False)
    shape_corrections: dict[str, ShapeCorrection] = field(default_factory=dict, hash=False, repr=False)
    l2_cache_bytes: float = 0.0  # last-level cache (datasheet); 0: the curves see no cache term
    num_sms: int = 0  # streaming multiprocessors (datasheet); 0: the curves see no wave quantisation
    tp_link: LinkSpec = field(default_factory=lambda: LINKS["nvlink"])  # intra-node link used by TP
    kind: str = "gpu"  # "gpu" or "cpu"
    source: str = ""
    # the device whose measured profiles the efficiency curves and host terms were fitted on ("" : none, the
    # curves are estimates); a preset that borrows another GPU's fit names that GPU (specs.gpu_provenance)
    fitted_on: str = ""

    def __post_init__(self) -> None:
        for f in ("peak_flops", "mem_bandwidth_bytes_s", "mem_capacity_bytes"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f}: must be > 0, got {getattr(self, f)!r} (hardware {self.name!r})")
        for f in ("compute_eff_max", "memory_eff_max", "attention_eff_ratio"):
            if not 0 < getattr(self, f) <= 1.0:
                raise ValueError(f"{f}: must be in (0, 1], got {getattr(self, f)!r} (hardware {self.name!r})")
        if not 0 < self.kv_memory_eff_ratio <= 10.0:
            raise ValueError(
                f"kv_memory_eff_ratio: must be in (0, 10], got {self.kv_memory_eff_ratio!r} (hardware {self.name!r})"
            )
        for f in _NON_NEGATIVE:
            if getattr(self, f) < 0:
                raise ValueError(f"{f}: must be >= 0, got {getattr(self, f)!r} (hardware {self.name!r})")
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"kind: must be 'gpu' or 'cpu', got {self.kind!r} (hardware {self.name!r})")
        for cls, curve in self.elementwise_curves.items():
            if cls not in ELEMENTWISE_CLASSES:
                raise ValueError(
                    f"elementwise_curves: unknown class {cls!r} (known: {', '.join(ELEMENTWISE_CLASSES)}) "
                    f"(hardware {self.name!r})"
                )
            if not isinstance(curve, MemoryCurve):
                raise ValueError(
                    f"elementwise_curves: {cls!r} must be a MemoryCurve (hardware {self.name!r})"
                )
        for key, corr in self.shape_corrections.items():
            if not isinstance(key, str) or not isinstance(corr, ShapeCorrection):
                raise ValueError(
                    f"shape_corrections: {key!r} must map a kernel key to a ShapeCorrection (hardware {self.name!r})"
                )

    def host_overhead_s(self, num_seqs: int, num_tokens: int, tp: int = 1) -> float:
        """Engine host time of one step over ``num_seqs`` sequences and ``num_tokens`` tokens."""
        extra = (
            self.host_overhead_tp_s
            + self.host_overhead_tp_per_seq_s * num_seqs
            + self.host_overhead_per_tp_rank_s * (tp - 1)
            if tp > 1
            else 0.0
        )
        return (
            self.step_overhead_s
            + extra
            + self.host_overhead_per_seq_s * num_seqs
            + self.host_overhead_per_token_s * num_tokens
        )

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a saturated operator is compute-bound."""
        return (self.peak_flops * self.compute_eff_max) / (self.mem_bandwidth_bytes_s * self.memory_eff_max)

    def with_(self, **changes: Any) -> HardwareSpec:
        """A copy with some fields changed (validated)."""
        return replace(self, **changes)

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape_corrections"] = {  # lists, not tuples: YAML's safe dumper writes lists only
            k: {"tokens": [int(t) if t.is_integer() else t for t in c.tokens], "log_ratio": list(c.log_ratio)}
            | ({"tile_tokens": c.tile_tokens} if c.tile_tokens else {})
            for k, c in self.shape_corrections.items()
        }
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareSpec:
        if not isinstance(data, dict):
            raise ValueError(f"hardware: expected a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"hardware: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        d = dict(data)
        link = d.get("tp_link")
        if isinstance(link, str):
            d["tp_link"] = get_link(link)
        elif isinstance(link, dict):
            d["tp_link"] = LinkSpec(**link)
        if "mem_capacity_bytes" in d:
            d["mem_capacity_bytes"] = int(d["mem_capacity_bytes"])
        for name, item_cls in (("elementwise_curves", MemoryCurve), ("shape_corrections", ShapeCorrection)):
            if d.get(name) is not None:
                d[name] = _typed_mapping(name, d[name], item_cls)
        try:
            return cls(**d)
        except TypeError as e:  # a required field is missing
            raise ValueError(f"hardware: {e}") from None

    def to_json(self) -> str:
        """Indented JSON; each shape correction on one line (a fitted GPU has thousands of knots)."""
        d = self.to_dict()
        corr = d.pop("shape_corrections")
        text = json.dumps(d, indent=2)
        if not corr:
            return text[:-2] + ',\n  "shape_corrections": {}\n}'
        lines = [f"    {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in corr.items()]
        return text[:-2] + ',\n  "shape_corrections": {\n' + ",\n".join(lines) + "\n  }\n}"

    def save(self, path: str | os.PathLike) -> None:
        """Write as YAML (``.yaml``/``.yml``) or JSON (anything else)."""
        p = Path(path)
        if p.suffix in (".yaml", ".yml"):
            import yaml

            p.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            p.write_text(self.to_json() + "\n")


def load_hardware(path: str | os.PathLike) -> HardwareSpec:
    """Read a HardwareSpec written by :meth:`HardwareSpec.save` (JSON or YAML)."""
    p = Path(path)
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    return HardwareSpec.from_dict(data)
