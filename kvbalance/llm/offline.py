"""``LLM``: the offline API over :class:`~kvbalance.llm.engine.LLMEngine`::

from kvbalance import LLM, SamplingParams
llm = LLM(model="smollm2-135m")
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbalance.llm.engine import LLMEngine
from kvbalance.request import RequestState, SamplingParams


@dataclass
class CompletionOutput:
    """A finished generation, as returned by :meth:`LLM.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


class LLM:
    """Offline batch generation: ``LLM(model=...).generate(prompts, params)``."""

    def __init__(self, model: str = "smollm2-135m", **engine_kwargs) -> None:
        self.engine = LLMEngine(model, **engine_kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_progress: bool = False,
    ) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        return self._run([self.engine.encode(p) for p in prompts], params, use_progress)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        use_progress: bool = False,
    ) -> list[CompletionOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ids = [self.engine.chat_prompt(m) for m in conversations]
        return self._run(ids, [sampling_params or SamplingParams()] * len(ids), use_progress)

    def _run(
        self, ids: list[list[int]], params: list[SamplingParams], use_progress: bool
    ) -> list[CompletionOutput]:
        eng = self.engine
        reqs = [eng.add_request(p, sp) for p, sp in zip(ids, params)]
        texts: dict[str, str] = {}
        if use_progress:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task("generating", total=len(reqs))
                while eng.has_unfinished():
                    for out in eng.step():
                        if out.finished:
                            texts[out.request_id] = out.text
                            bar.advance(task)
        else:
            while eng.has_unfinished():
                for out in eng.step():
                    if out.finished:
                        texts[out.request_id] = out.text
        results = []
        for r in reqs:
            if r.state is RequestState.REJECTED:
                raise ValueError(f"prompt {r.request_id}: {r.reject_reason}")
            text = texts.get(r.request_id)
            if text is None:
                text = (
                    eng.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
                    if eng.tokenizer is not None
                    else ""
                )
            eng._detok.pop(r.request_id, None)
            results.append(
                CompletionOutput(
                    r.request_id,
                    list(r.prompt_token_ids),
                    list(r.output_token_ids),
                    text,
                    r.finish_reason,
                    list(r.output_logprobs),
                    {"ttft_s": r.ttft_s, "e2e_s": r.e2e_s},
                )
            )
        return results
