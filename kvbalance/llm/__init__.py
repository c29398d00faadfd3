"""The real engine: an Instance over the PyTorch executor, with tokenizer, stop strings and streaming.

``LLMEngine`` runs the same scheduler and KV cache as the simulator on the wall clock;
``LLM`` is the offline API on top of it::

    from kvbalance import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from kvbalance.llm.engine import LLMEngine, RequestOutput
from kvbalance.llm.offline import LLM, CompletionOutput
from kvbalance.llm.text import Detokenizer

__all__ = ["LLM", "CompletionOutput", "Detokenizer", "LLMEngine", "RequestOutput"]
