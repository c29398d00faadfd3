"""kvbalance: an LLM-serving control plane built around the KV cache.

One scheduler, paged KV cache and prefix cache drive either a GPU cost-model simulator or a real
PyTorch model. ``LLM`` (offline generation) needs the ``torch`` extra and is imported lazily.
"""

from kvbalance.request import Request, RequestState, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "Request", "RequestState", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name in ("LLM", "LLMEngine"):
        from kvbalance import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'kvbalance' has no attribute {name!r}")
