"""The real model: a Llama-architecture decoder over a paged KV cache, its weights and sampling."""

from kvbalance.model.llama import LlamaConfig, LlamaModel, StepMetadata, build_step_metadata
from kvbalance.model.sampling import SampleRequest, TokenLogprobs, sample
from kvbalance.model.weights import (
    LoadedModel,
    RandomWeightsWarning,
    load_hf_dir,
    load_model,
    load_smollm2,
    random_weights,
)

__all__ = [
    "LlamaConfig",
    "LlamaModel",
    "LoadedModel",
    "RandomWeightsWarning",
    "SampleRequest",
    "StepMetadata",
    "TokenLogprobs",
    "build_step_metadata",
    "load_hf_dir",
    "load_model",
    "load_smollm2",
    "random_weights",
    "sample",
]
