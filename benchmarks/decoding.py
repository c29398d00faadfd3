"""An engine in steady decode, for the kernel benchmarks' in-engine A/B runs (bench_fused.py,
bench_gemm.py): ``batch`` sequences of ``context`` random prompt tokens, every one past its prefill."""

from __future__ import annotations

import random

from kvbalance.llm import LLMEngine
from kvbalance.request import SamplingParams


def decoding_engine(
    batch: int, context: int, max_tokens: int, seed: int = 0, dtype: str = "auto"
) -> LLMEngine:
    """SmolLM2-135M on one thread with ``batch`` requests of ``context`` tokens (``max_tokens`` each,
    EOS ignored), stepped until every request has its first output token: each further step decodes."""
    eng = LLMEngine("smollm2-135m", num_threads=1, dtype=dtype)
    rng = random.Random(seed)
    for _ in range(batch):
        prompt = [rng.randrange(1000, 40000) for _ in range(context)]
        eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sched = eng.instance.scheduler
    while sched.waiting or any(not r.output_token_ids for r in sched.running):
        eng.step()
    return eng
