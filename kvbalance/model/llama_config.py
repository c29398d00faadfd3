"""Shape and numerics of a Llama-architecture model (:class:`LlamaConfig`, from a ``ModelSpec`` or an HF
``config.json``) and its RoPE frequencies (:func:`rope_inv_freq`, with Llama 3.1 / linear scaling)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

LLAMA_LIKE_ARCHS = ("llama", "qwen2", "mistral", "smollm", "smollm2")


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama-architecture model (field names follow ``ModelSpec``)."""

    name: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    max_context: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF style: {"rope_type": "llama3" | "linear", "factor": ..., ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # HF Llama's ``attention_bias`` biases o_proj too; Qwen2 biases only q/k/v
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str | None = None  # the checkpoint's ``torch_dtype`` ("bfloat16", "float32", ...); None: not given

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}: must be >= 1, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} must divide num_heads {self.num_heads} (grouped-query attention)"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim: must be even and >= 2 for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise ValueError(f"rope_scaling: type {kind!r} not supported (default, linear, llama3)")

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_spec(cls, spec) -> LlamaConfig:
        """Build from anything with ``ModelSpec``'s field names (duck-typed, so no import of specs)."""
        arch = str(getattr(spec, "arch", "llama") or "llama").lower()
        if arch not in LLAMA_LIKE_ARCHS:
            raise ValueError(
                f"arch: {arch!r} is not a Llama-architecture model ({', '.join(LLAMA_LIKE_ARCHS)})"
            )
        heads = int(spec.num_heads)
        head_dim = getattr(spec, "head_dim", None) or spec.hidden_size // heads
        qkv_bias = bool(getattr(spec, "qkv_bias", False))
        return cls(
            name=str(getattr(spec, "name", arch)),
            vocab_size=int(spec.vocab_size),
            hidden_size=int(spec.hidden_size),
            intermediate_size=int(spec.intermediate_size),
            num_layers=int(spec.num_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(spec, "num_kv_heads", None) or heads),
            head_dim=int(head_dim),
            max_context=int(getattr(spec, "max_context", 4096) or 4096),
            rms_norm_eps=float(getattr(spec, "rms_norm_eps", 1e-5) or 1e-5),
            rope_theta=float(getattr(spec, "rope_theta", 10000.0) or 10000.0),
            rope_scaling=_rope_scaling_or_none(getattr(spec, "rope_scaling", None)),
            tie_word_embeddings=bool(getattr(spec, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=qkv_bias and bool(getattr(spec, "linear_bias", False)),
            bos_token_id=getattr(spec, "bos_token_id", None),
            eos_token_id=getattr(spec, "eos_token_id", None),
        )

    @classmethod
    def from_hf_config(cls, d: dict) -> LlamaConfig:
        """Build from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2; transformers 4 or 5 keys)."""
        model_type = str(d.get("model_type", "llama")).lower()
        if model_type not in LLAMA_LIKE_ARCHS:
            raise ValueError(f"model_type: {model_type!r} is not a Llama-architecture model")
        heads = int(d["num_attention_heads"])
        rope_params = dict(d.get("rope_parameters") or {})
        theta = d.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or rope_params or None
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            name=str(d.get("_name_or_path") or model_type),
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            max_context=int(d.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=_rope_scaling_or_none(scaling),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            dtype=_dtype_name(d.get("torch_dtype") or d.get("dtype")),
        )

    def to_hf_config(self) -> dict:
        """A ``config.json``-style dict for ``transformers.LlamaConfig`` (tests, saving)."""
        if self.qkv_bias != self.o_bias:
            raise ValueError("qkv_bias: HF Llama biases q/k/v/o together; this config differs (Qwen2-style)")
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
            rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_context,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }

    def to_dict(self) -> dict:
        return asdict(self)


def _dtype_name(dtype) -> str | None:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` -> ``"bfloat16"`` (None stays None)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _rope_scaling_or_none(scaling) -> dict | None:
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("type", None) or scaling.get("rope_type", "default")
    scaling["rope_type"] = kind
    scaling.pop("rope_theta", None)
    return None if kind == "default" and len(scaling) == 1 else scaling


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim / 2] in float32, with ``linear`` or ``llama3`` scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend linearly in wavelength between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling.get("original_max_position_embeddings", config.max_context))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(middle, blended, inv_freq)
    return inv_freq
