"""Model, GPU and link specifications with cited presets: the shapes and peak numbers the cost model
and the KV-capacity arithmetic are built on.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

ARCHS = ("llama", "opt")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape.

    ``arch="llama"``: SwiGLU gated MLP (gate, up, down), RMSNorm, RoPE, no linear biases (Qwen2 adds
    ``qkv_bias``). ``arch="opt"``: ReLU two-matrix MLP (fc1, fc2), LayerNorm, learned positions,
    biases on every linear (``linear_bias``).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    dtype_bytes: int = 2  # 2 for fp16 / bf16
    arch: str = "llama"
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2)
    linear_bias: bool = False  # bias on every linear (OPT)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    hf_id: str = ""  # Hugging Face repository the shape comes from

    def __post_init__(self) -> None:
        for f in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_context",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f}: must be a positive integer, got {v!r} (model {self.name!r})")
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(
                f"dtype_bytes: must be 1, 2 or 4, got {self.dtype_bytes!r} (model {self.name!r})"
            )
        if self.arch not in ARCHS:
            raise ValueError(
                f"arch: must be one of {', '.join(ARCHS)}, got {self.arch!r} (model {self.name!r})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads} (model {self.name!r})"
            )

    # -- derived sizes ------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def mlp_in_matrices(self) -> int:
        """Matrices multiplying the MLP input: gate + up (llama) or fc1 (opt)."""
        return 2 if self.arch == "llama" else 1

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers: 2 * layers * kv_heads * head_dim * dtype."""
        return self.kv_bytes_per_gpu(1)

    def kv_bytes_per_gpu(self, tp: int = 1) -> int:
        """Bytes of K and V for one token on each of ``tp`` GPUs (the project's one KV-size formula):
        2 * layers * ceil(kv_heads / tp) * head_dim * dtype (KV heads fewer than tp are replicated)."""
        return 2 * self.num_layers * -(-self.num_kv_heads // tp) * self.head_dim * self.dtype_bytes

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block (projections, MLP, norms, biases)."""
        h, q, kv, inter = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        attn = h * (q + 2 * kv) + q * h
        mlp = (self.mlp_in_matrices + 1) * h * inter
        norms = 2 * h if self.arch == "llama" else 4 * h  # RMSNorm weight / LayerNorm weight + bias
        bias = 0
        if self.qkv_bias or self.linear_bias:
            bias += q + 2 * kv
        if self.linear_bias:
            bias += h + self.mlp_in_matrices * inter + h
        return attn + mlp + norms + bias

    @property
    def embedding_params(self) -> int:
        pos = (self.max_context + 2) * self.hidden_size if self.arch == "opt" else 0  # OPT: offset of 2
        return self.vocab_size * self.hidden_size + pos

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        final_norm = self.hidden_size if self.arch == "llama" else 2 * self.hidden_size
        return self.embedding_params + self.num_layers * self.layer_params + final_norm + self.lm_head_params

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes


def _llama(name: str, hf_id: str, **kw: Any) -> ModelSpec:
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_heads"])
    return ModelSpec(name=name, hf_id=hf_id, arch="llama", **kw)


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_MODEL_LIST = [
    # LLaMA-1: huggyllama/llama-7b and huggyllama/llama-13b config.json (conversions of the Meta release).
    _llama("llama-7b", "huggyllama/llama-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
           intermediate_size=11008, vocab_size=32000, max_context=2048, rms_norm_eps=1e-6,
           bos_token_id=1, eos_token_id=2),
    _llama("llama-13b", "huggyllama/llama-13b", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40,
           intermediate_size=13824, vocab_size=32000, max_context=2048, rms_norm_eps=1e-6,
           bos_token_id=1, eos_token_id=2),
    # Llama 2: meta-llama/Llama-2-7b-hf and meta-llama/Llama-2-13b-hf config.json.
    _llama("llama-2-7b", "meta-llama/Llama-2-7b-hf", num_layers=32, hidden_size=4096, num_heads=32,
           num_kv_heads=32, intermediate_size=11008, vocab_size=32000, max_context=4096, rms_norm_eps=1e-5,
           bos_token_id=1, eos_token_id=2),
    _llama("llama-2-13b", "meta-llama/Llama-2-13b-hf", num_layers=40, hidden_size=5120, num_heads=40,
           num_kv_heads=40, intermediate_size=13824, vocab_size=32000, max_context=4096, rms_norm_eps=1e-5,
           bos_token_id=1, eos_token_id=2),
    # OPT-13B: facebook/opt-13b config.json (ffn_dim 20480, max_position_embeddings 2048, tied head,
    # enable_bias true, do_layer_norm_before true).
    ModelSpec(name="opt-13b", hf_id="facebook/opt-13b", arch="opt", num_layers=40, hidden_size=5120,
              num_heads=40, num_kv_heads=40, head_dim=128, intermediate_size=20480, vocab_size=50272,
              max_context=2048, tie_word_embeddings=True, rope_theta=0.0, rms_norm_eps=1e-5,
              qkv_bias=True, linear_bias=True, bos_token_id=2, eos_token_id=2),
    # Llama 3 / 3.1: meta-llama/Meta-Llama-3-8B, meta-llama/Llama-3.1-8B, meta-llama/Llama-3.1-70B config.json.
    _llama("llama-3-8b", "meta-llama/Meta-Llama-3-8B", num_layers=32, hidden_size=4096, num_heads=32,
           num_kv_heads=8, intermediate_size=14336, vocab_size=128256, max_context=8192, rope_theta=500000.0,
           rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001),
    _llama("llama-3.1-8b", "meta-llama/Llama-3.1-8B", num_layers=32, hidden_size=4096, num_heads=32,
           num_kv_heads=8, intermediate_size=14336, vocab_size=128256, max_context=131072,
           rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE), rms_norm_eps=1e-5, bos_token_id=128000,
           eos_token_id=128001),
    _llama("llama-3.1-70b", "meta-llama/Llama-3.1-70B", num_layers=80, hidden_size=8192, num_heads=64,
           num_kv_heads=8, intermediate_size=28672, vocab_size=128256, max_context=131072,
           rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE), rms_norm_eps=1e-5, bos_token_id=128000,
           eos_token_id=128001),
    # Qwen2.5 instruct models: Qwen/Qwen2.5-{7B,32B,72B}-Instruct config.json (q/k/v bias, native 32K
    # context; 128K needs YaRN rope scaling, not enabled by default).
    _llama("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", num_layers=28, hidden_size=3584, num_heads=28,
           num_kv_heads=4, intermediate_size=18944, vocab_size=152064, max_context=32768, rope_theta=1e6,
           rms_norm_eps=1e-6, qkv_bias=True, bos_token_id=151643, eos_token_id=151645),
    _llama("qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", num_layers=64, hidden_size=5120, num_heads=40,
           num_kv_heads=8, intermediate_size=27648, vocab_size=152064, max_context=32768, rope_theta=1e6,
           rms_norm_eps=1e-6, qkv_bias=True, bos_token_id=151643, eos_token_id=151645),
    _llama("qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct", num_layers=80, hidden_size=8192, num_heads=64,
           num_kv_heads=8, intermediate_size=29568, vocab_size=152064, max_context=32768, rope_theta=1e6,
           rms_norm_eps=1e-6, qkv_bias=True, bos_token_id=151643, eos_token_id=151645),
    # SmolLM2-135M: HuggingFaceTB/SmolLM2-135M config.json.
    _llama("smollm2-135m", "HuggingFaceTB/SmolLM2-135M", num_layers=30, hidden_size=576, num_heads=9,
           num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152, max_context=8192,
           tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0),
    # Tiny test shapes (no checkpoint): small enough for exhaustive tests on a CPU.
    _llama("tiny-llama", "", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
           intermediate_size=128, vocab_size=256, max_context=512, tie_word_embeddings=True,
           bos_token_id=1, eos_token_id=2),
    _llama("tiny-llama-untied", "", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
           intermediate_size=128, vocab_size=256, max_context=512, tie_word_embeddings=False,
           bos_token_id=1, eos_token_id=2),
]  # fmt: skip

MODELS: dict[str, ModelSpec] = {m.name: m for m in _MODEL_LIST}


# ----------------------------------------------------------------------------------------------
# Links
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkSpec:
    """A point-to-point link: bandwidth in one direction and a per-transfer latency."""

    name: str
    bandwidth_bytes_s: float
    latency_s: float = 0.0
    note: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_s > 0:
            raise ValueError(
                f"bandwidth_bytes_s: must be > 0, got {self.bandwidth_bytes_s!r} (link {self.name!r})"
            )
        if self.latency_s < 0:
            raise ValueError(f"latency_s: must be >= 0, got {self.latency_s!r} (link {self.name!r})")


LINKS: dict[str, LinkSpec] = {
    lk.name: lk
    for lk in [
        LinkSpec(
            "nvlink", 300e9, 8e-6, "A100 NVLink3: 600 GB/s bidirectional per GPU -> 300 GB/s per direction"
        ),
        LinkSpec(
            "nvlink4",
            450e9,
            8e-6,
            "H100/H200 NVLink4: 900 GB/s bidirectional per GPU -> 450 GB/s per direction",
        ),
        LinkSpec("pcie4", 25e9, 10e-6, "PCIe 4.0 x16: 32 GB/s per direction nominal, ~25 GB/s achieved"),
        LinkSpec("pcie5", 50e9, 10e-6, "PCIe 5.0 x16: 64 GB/s per direction nominal, ~50 GB/s achieved"),
        LinkSpec("net-100g", 12.5e9, 10e-6, "100 Gb/s NIC (RDMA): 12.5 GB/s"),
        LinkSpec("net-200g", 25e9, 10e-6, "200 Gb/s NIC (RDMA): 25 GB/s"),
        LinkSpec("net-400g", 50e9, 10e-6, "400 Gb/s NIC (RDMA): 50 GB/s"),
    ]
}


# ----------------------------------------------------------------------------------------------
# Hardware
# ----------------------------------------------------------------------------------------------

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
    linearly in log M, beyond the ends it holds the end value (``kvbalance.perf.correction``)."""

    tokens: tuple[float, ...]
    log_ratio: tuple[float, ...]

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
    fitted on this GPU's own measurements carries them (presets that borrow a fit do not).
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
        curves = d.get("elementwise_curves")
        if curves is not None:
            if not isinstance(curves, dict):
                raise ValueError(f"elementwise_curves: expected a mapping, got {type(curves).__name__}")
            try:
                d["elementwise_curves"] = {
                    k: v if isinstance(v, MemoryCurve) else MemoryCurve(**v) for k, v in curves.items()
                }
            except TypeError as e:
                raise ValueError(
                    f"elementwise_curves: {e} (fields: {', '.join(f.name for f in fields(MemoryCurve))})"
                ) from None
        corr = d.get("shape_corrections")
        if corr is not None:
            if not isinstance(corr, dict):
                raise ValueError(f"shape_corrections: expected a mapping, got {type(corr).__name__}")
            try:
                d["shape_corrections"] = {
                    k: v if isinstance(v, ShapeCorrection) else ShapeCorrection(**v) for k, v in corr.items()
                }
            except TypeError as e:
                raise ValueError(f"shape_corrections: {e} (fields: tokens, log_ratio)") from None
            except ValueError as e:
                raise ValueError(f"shape_corrections: {e}") from None
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


def _gpu(name: str, peak: float, bw: float, cap_mib: int, link: str, source: str, **kw: Any) -> HardwareSpec:
    # memory_half_bytes: Little's law, bytes in flight to cover ~0.5 us of DRAM latency at full bandwidth.
    kw.setdefault("memory_half_bytes", round(bw * 0.5e-6))
    return HardwareSpec(
        name=name,
        peak_flops=peak,
        mem_bandwidth_bytes_s=bw,
        mem_capacity_bytes=cap_mib * MIB,
        tp_link=LINKS[link],
        source=source,
        **kw,
    )


_EFF_NOTE = (
    " Efficiency defaults (no fit): GEMMs saturate at 55% of peak with half efficiency at M=16 tokens,"
    " memory-bound kernels at 90% of peak bandwidth, attention at 0.8x the GEMM fraction; 1 ms per step,"
    " 8 us per layer. Estimates, not fits."
)
# Fitted presets written by ``kvbalance calibrate`` (package data): efficiency curves, kernel latency, host
# overhead and TP link fitted on measured profiles; the datasheet peaks stay as given.
FITS_DIR = Path(__file__).resolve().parent / "perf" / "fits"
# What a fit transfers to another GPU: everything except peaks, bandwidth, capacity, L2, link, name, source.
FITTED_FIELDS = (
    "compute_eff_max",
    "compute_half_tokens",
    "memory_eff_max",
    "memory_half_bytes",
    "attention_eff_ratio",
    "kv_memory_eff_ratio",
    "step_overhead_s",
    "per_layer_overhead_s",
    "kernel_latency_s",
    "host_overhead_per_seq_s",
    "host_overhead_per_token_s",
    "host_overhead_tp_s",
    "host_overhead_tp_per_seq_s",
    "host_overhead_per_tp_rank_s",
    "elementwise_curves",
)


def _fit(name: str) -> HardwareSpec | None:
    path = FITS_DIR / f"{name}.json"
    return load_hardware(path) if path.is_file() else None


def _borrow(
    datasheet: HardwareSpec, fit: HardwareSpec | None, why: str, link: bool = False, own: bool = False
) -> HardwareSpec:
    """``datasheet``'s peaks with ``fit``'s efficiency curves and overheads (and its TP link if ``link``; and
    its measured-shape corrections if ``own``: the fit was made on this very GPU)."""
    if fit is None:
        return datasheet.with_(source=datasheet.source + _EFF_NOTE)
    extra: dict[str, Any] = {"tp_link": fit.tp_link} if link else {}
    if own:
        extra["shape_corrections"] = fit.shape_corrections
    fitted = {f: getattr(fit, f) for f in FITTED_FIELDS}
    return datasheet.with_(**fitted, **extra, source=f"{datasheet.source} {why} Fit: {fit.source}")


_DATASHEETS = {
    g.name: g
    for g in [
        # NVIDIA A100 datasheet: 312 TFLOPS fp16/bf16 tensor dense; 1,555 GB/s (40GB), 2,039 GB/s (80GB SXM);
        # 40 MB L2; 108 SMs. Capacity: nvidia-smi total (40960 / 81920 MiB).
        _gpu("a100-40gb", 312e12, 1555e9, 40960, "nvlink", "NVIDIA A100 datasheet (SXM4 40GB).", l2_cache_bytes=40e6, num_sms=108),
        _gpu("a100-80gb", 312e12, 2039e9, 81920, "nvlink", "NVIDIA A100 datasheet (SXM4 80GB).", l2_cache_bytes=40e6, num_sms=108),
        # NVIDIA H100 datasheet, SXM5: 989 TFLOPS bf16 dense (1,979 with sparsity), 3.35 TB/s, 80GB
        # (nvidia-smi: 81559 MiB); 50 MB L2; 132 SMs.
        _gpu("h100-sxm", 989e12, 3.35e12, 81559, "nvlink4", "NVIDIA H100 datasheet (SXM5).", l2_cache_bytes=50e6, num_sms=132),
        # NVIDIA H200 datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e, 141GB (nvidia-smi: 143771 MiB); the
        # H100's GH100 die (50 MB L2, 132 SMs).
        _gpu("h200", 989e12, 4.8e12, 143771, "nvlink4", "NVIDIA H200 datasheet (SXM).", l2_cache_bytes=50e6, num_sms=132),
        # NVIDIA L40S datasheet: 362 TFLOPS fp16/bf16 tensor dense (733 with sparsity), 864 GB/s GDDR6,
        # 48GB (nvidia-smi: 46068 MiB with ECC), 96 MB L2, 142 SMs; PCIe 4.0 x16, no NVLink.
        _gpu("l40s", 362e12, 864e9, 46068, "pcie4", "NVIDIA L40S datasheet.", l2_cache_bytes=96e6, num_sms=142),
        # NVIDIA A40 datasheet: 149.7 TFLOPS fp16 tensor dense (299.4 with sparsity), 696 GB/s GDDR6, 48GB
        # (nvidia-smi: 46068 MiB with ECC), 6 MB L2, 84 SMs (GA102); PCIe 4.0 x16 (NVLink bridge pairs only).
        _gpu("a40", 149.7e12, 696e9, 46068, "pcie4", "NVIDIA A40 datasheet.", l2_cache_bytes=6e6, num_sms=84),
    ]
}  # fmt: skip


def _presets() -> dict[str, HardwareSpec]:
    d, h100, a40 = _DATASHEETS, _fit("h100-sxm"), _fit("a40")
    ampere = (
        "Efficiency curves and overheads borrowed from the A40 fit (the closest fitted architecture: Ampere;"
        " risk: A100's HBM2e and 40 MB L2 and L40S's Ada SMs differ from the A40's GDDR6 and 6 MB L2, so the"
        " memory-bound fractions and GEMM half-size may be off by tens of percent)."
    )
    hopper = "Efficiency curves, overheads and TP link from the H100 fit (same GH100 die; bandwidth, capacity own)."
    return {
        "a100-40gb": _borrow(d["a100-40gb"], a40, ampere),
        "a100-80gb": _borrow(d["a100-80gb"], a40, ampere),
        "h100-sxm": _borrow(d["h100-sxm"], h100, "Fitted on H100 measurements.", link=True, own=True),
        "h200": _borrow(d["h200"], h100, hopper, link=True),
        "l40s": _borrow(d["l40s"], a40, ampere.replace("A40 fit (", "A40 fit (for Ada: ")),
        "a40": _borrow(d["a40"], a40, "Fitted on A40 measurements.", own=True),
    }


GPUS: dict[str, HardwareSpec] = _presets()

_GPU_ALIASES = {
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "a100-40g": "a100-40gb",
    "a100-80g": "a100-80gb",
    "h200-sxm": "h200",
}

_MODEL_ALIASES = {m.hf_id.lower(): m.name for m in _MODEL_LIST if m.hf_id}
_MODEL_ALIASES.update(
    {
        "llama2-7b": "llama-2-7b",
        "llama2-13b": "llama-2-13b",
        "llama3-8b": "llama-3-8b",
        "llama3.1-8b": "llama-3.1-8b",
        "llama3.1-70b": "llama-3.1-70b",
        "smollm2": "smollm2-135m",
    }
)


def _lookup(table: dict, aliases: dict[str, str], field_name: str, name: str) -> Any:
    if not isinstance(name, str):
        raise ValueError(f"{field_name}: expected a name, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-")
    key = aliases.get(key, aliases.get(name.strip().lower(), key))
    if key in table:
        return table[key]
    raise ValueError(f"{field_name}: unknown {name!r} (known: {', '.join(table)})")


def get_model(name: str | ModelSpec) -> ModelSpec:
    """Preset by name (case-insensitive; Hugging Face ids accepted). A ModelSpec passes through."""
    if isinstance(name, ModelSpec):
        return name
    return _lookup(MODELS, _MODEL_ALIASES, "model", name)


HARDWARE_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def get_gpu(name: str | os.PathLike | HardwareSpec) -> HardwareSpec:
    """Preset by name (case-insensitive; "h100" means h100-sxm), or a saved spec file (``.json``/``.yaml``/
    ``.yml``, e.g. the ``hardware.json`` that ``kvbalance profile`` fits). A HardwareSpec passes through."""
    if isinstance(name, HardwareSpec):
        return name
    if isinstance(name, os.PathLike) or (
        isinstance(name, str) and name.lower().endswith(HARDWARE_FILE_SUFFIXES)
    ):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"gpu: no such hardware file {str(path)!r}")
        import yaml

        try:
            return load_hardware(path)
        except (OSError, ValueError, yaml.YAMLError) as e:  # JSONDecodeError is a ValueError
            raise ValueError(f"gpu: cannot read hardware file {str(path)!r} ({e})") from None
    return _lookup(GPUS, _GPU_ALIASES, "gpu", name)


def get_link(name: str | LinkSpec) -> LinkSpec:
    """Preset by name (case-insensitive). A LinkSpec passes through."""
    if isinstance(name, LinkSpec):
        return name
    return _lookup(LINKS, {"nvlink3": "nvlink"}, "link", name)


def list_models() -> list[str]:
    return list(MODELS)


def list_gpus() -> list[str]:
    return list(GPUS)


def list_links() -> list[str]:
    return list(LINKS)
