"""The real engine: an Instance over the PyTorch executor, with tokenizer, stop strings and streaming.

``LLMEngine`` runs the same scheduler and KV cache as the simulator on the wall clock;
``LLM`` is the offline API on top of it::

    from kvbalance import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbalance.engine import InstanceConfig, build_instance
from kvbalance.request import Request, RequestState, SamplingParams


@dataclass
class RequestOutput:
    """One request's progress after a step: the new tokens and text since the previous output."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    request: Request
    text: str = ""  # all output text so far (stop strings cut off)


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


class _Detok:
    """Incremental detokenisation with a small window (holds back incomplete UTF-8 sequences)."""

    __slots__ = ("prefix_offset", "read_offset", "text", "sent")

    def __init__(self) -> None:
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.sent = 0  # characters of ``text`` already emitted as deltas

    def step(self, tokenizer, ids: list[int]) -> str:
        prefix = tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            self.text += delta
            return delta
        return ""


class LLMEngine:
    """Continuous-batching engine over a real model (CPU or CUDA)."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        kv_cache_tokens: int = 65_536,
        block_size: int | None = None,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        policy: str = "sarathi",
        enable_prefix_caching: bool = True,
        device: str = "cpu",
        dtype: str = "float32",
        num_threads: int | None = None,
        seed: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        import torch

        from kvbalance.executor.torch import TorchExecutor
        from kvbalance.model.weights import load_model

        if block_size is None:
            # CPU decode attention reads each block of each KV head as one run: 64-token blocks keep the
            # hardware prefetcher streaming (~25% faster attention than 16 on this machine); GPUs use 16.
            block_size = 64 if str(device).startswith("cpu") else 16
        if kv_cache_tokens < block_size:
            raise ValueError(f"kv_cache_tokens: must be >= block_size ({block_size}), got {kv_cache_tokens}")
        try:
            torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
                dtype
            ]
        except KeyError:
            raise ValueError(f"dtype: must be float32, float16 or bfloat16, got {dtype!r}") from None
        loaded = load_model(model, seed=seed)
        self.model_name = model
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.random_weights = loaded.random_weights
        num_blocks = kv_cache_tokens // block_size
        self.executor = TorchExecutor(
            loaded.config, loaded.state_dict, num_blocks, block_size, device, torch_dtype, num_threads
        )
        max_ctx = min(max_model_len or self.config.max_context, self.config.max_context)
        icfg = InstanceConfig(
            kv_tokens=num_blocks * block_size,
            block_size=block_size,
            policy=policy,
            chunk_size=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            max_context=max_ctx,
        )
        self.instance = build_instance(icfg, self.executor)
        self.eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, _Detok] = {}
        self._ids = itertools.count()
        self._t0 = time.perf_counter()
        self.step_log: list[tuple[int, int, float, float]] = []  # (tokens, seqs, duration_s, forward_s)

    # -- clock -------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    # -- requests ----------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has random weights and no tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt))
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt: token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )
        return ids

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]: needs 'role' and 'content'")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        """Queue a prompt. A request that can never run comes back REJECTED with ``reject_reason``."""
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt: empty")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id: {rid!r} is already in use")
        req = Request(
            rid, ids, params or SamplingParams(), arrival_s=self.now(), eos_token_id=self.eos_token_id
        )
        if self.instance.add_request(req, self.now()):
            self.requests[rid] = req
            self._detok[rid] = _Detok()
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.instance.abort(req, self.now())

    def has_unfinished(self) -> bool:
        return self.instance.has_work()

    # -- stepping ----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outcome = self.instance.step(self.now())
        if outcome is None:
            return []
        finished = {r.request_id for r in self.instance.complete(outcome, self.now())}
        res = outcome.result
        self.step_log.append(
            (outcome.plan.num_tokens, len(outcome.plan.seqs), res.duration_s, res.breakdown.compute_s)
        )
        outputs: list[RequestOutput] = []
        for s in outcome.plan.seqs:
            if not s.sample:
                continue
            req = s.request
            if req.request_id not in self.requests:
                continue
            token = req.output_token_ids[-1] if req.output_token_ids else None
            delta = ""
            text = ""
            detok = self._detok.get(req.request_id)
            if self.tokenizer is not None and token is not None and detok is not None:
                added = detok.step(self.tokenizer, req.output_token_ids)
                if req.sampling.stop and added and not req.is_finished:
                    self._apply_stop_strings(req, detok, len(added))
                delta = self._emit(req, detok)
                text = detok.text
            done = req.is_finished or req.request_id in finished
            outputs.append(
                RequestOutput(
                    req.request_id,
                    [token] if token is not None else [],
                    delta,
                    done,
                    req.finish_reason,
                    req,
                    text,
                )
            )
            if done:
                self.requests.pop(req.request_id, None)
                self._detok.pop(req.request_id, None)
        return outputs

    @staticmethod
    def _emit(req: Request, detok: _Detok) -> str:
        """New text safe to send: text that could still turn out to start a stop string is held back."""
        end = len(detok.text)
        if req.sampling.stop and not req.is_finished:
            text = detok.text
            for stop in req.sampling.stop:
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        end = min(end, len(text) - k)
                        break
        end = max(end, detok.sent)
        delta = detok.text[detok.sent : end]
        detok.sent = end
        return delta

    def _apply_stop_strings(self, req: Request, detok: _Detok, added: int) -> None:
        text = detok.text
        window = max(len(s) for s in req.sampling.stop) + added
        tail_start = max(0, len(text) - window)
        cut = None
        for stop in req.sampling.stop:
            i = text.find(stop, tail_start)
            if i != -1 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            detok.text = text[:cut]
            self.instance.finish_request(req, "stop", self.now())

    def text_of(self, request_id: str) -> str:
        d = self._detok.get(request_id)
        return d.text if d else ""

    def run_until_done(self, progress=None) -> None:
        while self.has_unfinished():
            self.step()
            if progress is not None:
                progress()


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
