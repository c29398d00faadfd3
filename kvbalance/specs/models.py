"""Model presets (``ModelSpec``): the shapes the cost model and the KV-capacity arithmetic use, each cited
to its config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbalance.specs.lookup import _lookup

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
    # Llama-2-70B: meta-llama/Llama-2-70b-hf config.json (GQA: 8 KV heads; Vidur's reference model).
    _llama("llama-2-70b", "meta-llama/Llama-2-70b-hf", num_layers=80, hidden_size=8192, num_heads=64,
           num_kv_heads=8, intermediate_size=28672, vocab_size=32000, max_context=4096, rms_norm_eps=1e-5,
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


def get_model(name: str | ModelSpec) -> ModelSpec:
    """Preset by name (case-insensitive; Hugging Face ids accepted). A ModelSpec passes through."""
    if isinstance(name, ModelSpec):
        return name
    return _lookup(MODELS, _MODEL_ALIASES, "model", name)


def list_models() -> list[str]:
    return list(MODELS)
