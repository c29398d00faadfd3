"""Roofline cost model of one serving step: per-operator FLOPs and bytes on a HardwareSpec, plus tensor-parallel
all-reduce, kernel latencies, the serving engine's host time per step (:mod:`kvbalance.perf.engines`: serial, or
overlapped with the GPU step) and the LM head for sampling tokens only (DESIGN.md, "The cost model").

Per kernel: ``time = max(flops / (peak * eff_c(M)), bytes / (bw * eff_m)) + latency``; GEMMs and attention
use the compute curve ``eff_c(M) = compute_eff_max * M / (M + compute_half_tokens)``, element-wise kernels
their class's :class:`~kvbalance.specs.MemoryCurve` where the preset has one (``kvbalance calibrate`` fits
both on measured operator times). A kernel shape profiled on the preset's GPU is then scaled by its measured
correction (:mod:`kvbalance.perf.correction`): ``time * exp(log_ratio(M))``.

A step's GPU time is its kernels (compute, memory, kernel latencies) and all-reduces; the engine profile adds
its host time around them (``StepBreakdown.overhead_s`` holds the kernel latencies plus the host time the GPU
did not hide; :meth:`CostModel.host_time` says which part was hidden).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import reduce
from operator import add

from kvbalance.batch import BatchPlan, StepBreakdown
from kvbalance.perf.correction import ShapeCorrections, elementwise_key, gemm_key
from kvbalance.perf.engines import EngineProfile, HostTime, host_time, resolve_engine
from kvbalance.perf.kernels import (  # noqa: F401  (re-exported: callers import these from perf.cost)
    ATTENTION,
    ELEMENTWISE,
    ELEMENTWISE_OPS,
    GEMM,
    OpCount,
    OpTime,
    compute_time_s,
    curve_eff,
    elementwise_class,
    elementwise_counts,
    gemm_count,
    kernel_latency_s,
    memory_time_s,
    op_time,
)
from kvbalance.perf.memory import kv_bytes_per_token, validate_tp
from kvbalance.specs import HardwareSpec, LinkSpec, ModelSpec, get_gpu, get_link, get_model

# (num_new_tokens, context_len_after_step, samples)
SeqWork = tuple[int, int, bool]

# Token counts (and sampled counts) whose operator terms CostModel.step keeps; past it the memo starts over.
STEP_MEMO_MAX = 4096


# Per-layer and per-step operator names, in execution order (calibration relies on a fixed order).
OP_NAMES = (
    "embedding",
    "norm",
    "qkv_proj",
    "rope",
    "kv_write",
    "attn_prefill",
    "attn_decode",
    "o_proj",
    "mlp_up",
    "activation",
    "mlp_down",
    "residual_add",
    "final_norm",
    "lm_head",
)


def transfer_time(num_bytes: float, link: LinkSpec) -> float:
    """Seconds to move ``num_bytes`` over ``link``: latency + bytes / bandwidth (0 for nothing to move)."""
    if num_bytes < 0:
        raise ValueError(f"num_bytes: must be >= 0, got {num_bytes}")
    if num_bytes == 0:
        return 0.0
    return link.latency_s + num_bytes / link.bandwidth_bytes_s


def allreduce_time(num_bytes: float, tp: int, link: LinkSpec) -> float:
    """Ring all-reduce among ``tp`` GPUs: 2 (tp - 1) / tp * bytes / bandwidth + latency."""
    if tp <= 1 or num_bytes <= 0:
        return 0.0
    return 2.0 * (tp - 1) / tp * num_bytes / link.bandwidth_bytes_s + link.latency_s


def breakdown_total_s(b: StepBreakdown) -> float:
    """Duration of a step from its breakdown (the parts are disjoint)."""
    return b.compute_s + b.memory_s + b.overhead_s + b.comm_s + b.transfer_s


def tally(seqs: Sequence[SeqWork]) -> tuple[int, int, int, int, float, int, int]:
    """A step's sums over its sequences: (tokens, sampled sequences, prefill-chunk tokens, their summed
    context, the (query, key) pairs they attend causally, decode sequences, their summed context). Checks each
    sequence (a named error for a chunk of no tokens or a context shorter than it)."""
    tokens = sampled = pre_tokens = pre_ctx = dec_seqs = dec_ctx = 0
    pre_pairs = 0.0
    for n, ctx, sample in seqs:
        if n < 1:
            raise ValueError(f"num_new_tokens: must be >= 1, got {n}")
        if ctx < n:
            raise ValueError(f"context_len: {ctx} is smaller than num_new_tokens {n}")
        tokens += n
        if sample:
            sampled += 1
        if n == 1:
            dec_seqs += 1
            dec_ctx += ctx
        else:
            pre_tokens += n
            pre_ctx += ctx
            # token i of the chunk (0-based) sees ctx - n + i + 1 keys
            pre_pairs += n * (ctx - n) + n * (n + 1) / 2
    return tokens, sampled, pre_tokens, pre_ctx, pre_pairs, dec_seqs, dec_ctx


def plan_shape(plan: BatchPlan) -> tuple:
    """What the step time of ``plan`` depends on, read straight from its sequences (each ``(num_new_tokens,
    start + num_new_tokens, sample)``): (sequences, tokens, sampled, decode count, decode context sum, each
    prompt chunk's (new tokens, context) in order). Two plans of one shape take the same time to the last bit
    (the simulator's shape cache keys on it). Checks each sequence as :func:`tally` does."""
    tokens = sampled = dec_seqs = dec_ctx = 0
    chunks = []
    for s in plan.seqs:
        n = s.num_new_tokens
        if n < 1:
            raise ValueError(f"num_new_tokens: must be >= 1, got {n}")
        tokens += n
        if s.sample:
            sampled += 1
        if n == 1:
            dec_seqs += 1
            dec_ctx += s.start + 1
        else:
            ctx = s.start + n
            if ctx < n:
                raise ValueError(f"context_len: {ctx} is smaller than num_new_tokens {n}")
            chunks.append((n, ctx))
    c = plan.cohort_seqs  # decodes counted, not listed (BatchPlan): the same sums as if they were
    if c:
        return (
            len(plan.seqs) + c,
            tokens + c,
            sampled + c,
            dec_seqs + c,
            dec_ctx + plan.cohort_context,
            tuple(chunks),
        )
    return len(plan.seqs), tokens, sampled, dec_seqs, dec_ctx, tuple(chunks)


def shape_tally(shape: tuple) -> tuple[int, int, int, int, float, int, int]:
    """:func:`tally` of a :func:`plan_shape`: the same sums in the same order (the chunks' causal pairs summed
    in floats chunk by chunk), without building the per-sequence tuples."""
    _, tokens, sampled, dec_seqs, dec_ctx, chunks = shape
    pre_tokens = pre_ctx = 0
    pre_pairs = 0.0
    for n, ctx in chunks:
        pre_tokens += n
        pre_ctx += ctx
        pre_pairs += n * (ctx - n) + n * (n + 1) / 2
    return tokens, sampled, pre_tokens, pre_ctx, pre_pairs, dec_seqs, dec_ctx


def plan_tally(plan: BatchPlan) -> tuple[int, int, int, int, float, int, int]:
    """:func:`tally` of a plan's sequences, read straight from the plan (:func:`plan_shape`)."""
    return shape_tally(plan_shape(plan))


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads each TP rank stores (replicated when there are fewer KV heads than ranks)."""
    return max(model.num_kv_heads // tp, 1)


class CostModel:
    """Predicts a step's duration for ``model`` on ``gpu`` with tensor parallelism ``tp``.

    ``link`` is the TP interconnect (defaults to the GPU's ``tp_link``). All FLOPs and bytes are per GPU.
    ``engine`` is the serving engine whose host time the steps pay (an :class:`EngineProfile` or its name,
    :mod:`kvbalance.perf.engines`; None: the default, ``vllm-v1`` on a GPU). ``overhead_s`` is the
    batch-independent part of the engine's host work plus the per-layer launch gaps; :meth:`host_overhead_s`
    adds the parts that grow with the batch.
    """

    def __init__(
        self,
        model: ModelSpec | str,
        gpu: HardwareSpec | str,
        tp: int = 1,
        link: LinkSpec | str | None = None,
        engine: EngineProfile | str | None = None,
    ) -> None:
        self.model = get_model(model)
        self.gpu = get_gpu(gpu)
        self.engine = resolve_engine(engine, self.gpu)
        validate_tp(self.model, tp)
        self.tp = tp
        self.link = get_link(link) if link is not None else self.gpu.tp_link
        m = self.model
        dt = m.dtype_bytes
        self._h = m.hidden_size
        self._dt = dt
        self._q_r = m.q_dim // tp
        self._kv_r = kv_heads_per_rank(m, tp) * m.head_dim
        self._heads_r = m.num_heads // tp
        self._inter_r = m.intermediate_size // tp
        self._vocab_r = math.ceil(m.vocab_size / tp)
        self._norm_params = m.hidden_size if m.arch == "llama" else 2 * m.hidden_size
        self._kv_token_layer_bytes = 2 * self._kv_r * dt  # K and V of one token in one layer, this rank
        self.kv_bytes_per_token = kv_bytes_per_token(m, tp)
        # GEMM shapes (K, N) per rank, and bias elements added to their weights
        bias_qkv = self._q_r + 2 * self._kv_r if (m.qkv_bias or m.linear_bias) else 0
        bias_o = self._h if m.linear_bias else 0
        bias_up = m.mlp_in_matrices * self._inter_r if m.linear_bias else 0
        bias_down = self._h if m.linear_bias else 0
        self._gemms = {
            "qkv_proj": (self._h, self._q_r + 2 * self._kv_r, bias_qkv),
            "o_proj": (self._q_r, self._h, bias_o),
            "mlp_up": (self._h, m.mlp_in_matrices * self._inter_r, bias_up),
            "mlp_down": (self._inter_r, self._h, bias_down),
        }
        self.overhead_s = self.host_overhead_s(0, 0)
        self._ew_class = {name: elementwise_class(name, m.arch) for name in ELEMENTWISE_OPS}
        # per (kind, curve): the kernel latency, and where the class has a small-token path its threshold and
        # latency (kernels.kernel_latency_s, precomputed for the hot path)
        self._latency = {(k, c): kernel_latency_s(self.gpu, k, c) for k in (GEMM, ATTENTION) for c in ("",)}
        self._small: dict[tuple[str, str], tuple[float, float]] = {}
        for c in set(self._ew_class.values()):
            self._latency[(ELEMENTWISE, c)] = kernel_latency_s(self.gpu, ELEMENTWISE, c)
            curve = self.gpu.elementwise_curves.get(c)
            if curve is not None and curve.small_tokens > 0:
                self._small[(ELEMENTWISE, c)] = (curve.small_tokens, curve.small_latency_s)
        corr = self.gpu.shape_corrections
        self._corr = ShapeCorrections(corr, self.kernel_keys()) if corr else None
        if not self._corr:
            self._corr = None
        # CostModel.step's memo: per token count T, the terms of every operator that depends on T alone; per
        # sampled count, the LM head's (None: every step runs _step_plain)
        self._step_memo: dict[int, tuple] | None = {}
        self._gaps_s = self.gpu.per_layer_overhead_s * self.model.num_layers  # the per-layer launch gaps
        self._lm_memo: dict[int, tuple] = {}
        self._decode_fns: dict[int, Callable[[int], float]] = {}  # decode_step_fn's, per sequence count
        self._tally_memo: dict[tuple, tuple] = {}  # step_tallied's context-free values (_tally_fixed)
        self._attn_memo: dict[
            tuple, tuple
        ] = {}  # (attention op, its tokens, the step's if equal) -> _attn_terms

    def kernel_keys(self) -> dict[str, str | None]:
        """Each operator's kernel shape key (:mod:`kvbalance.perf.correction`); None: never profiled."""
        dt, h, ew = self._dt, self._h, self._ew_class
        keys: dict[str, str | None] = {n: gemm_key(k, n_, b > 0, dt) for n, (k, n_, b) in self._gemms.items()}
        keys["lm_head"] = gemm_key(h, self._vocab_r, False, dt)
        dims = {"embedding": (self._vocab_r, h), "norm": (h,), "final_norm": (h,), "rope": (self._q_r, self._kv_r),
                "activation": (self._inter_r,), "residual_add": (h,)}  # fmt: skip
        for name, d in dims.items():
            keys[name] = elementwise_key(ew[name], d, dt)
        # the TP degree too: the profiles time the same kernel differently at each degree (a few percent)
        keys = {name: f"{k}:tp{self.tp}" for name, k in keys.items()}
        keys["kv_write"] = None  # not in the profiles: it borrows the rotary curve, not its measurements
        return keys

    def correction(self, name: str, tokens: float) -> float:
        """measured / physical time of one launch of ``name`` over ``tokens`` tokens (1: physical model)."""
        return self._corr.factor(name, float(tokens)) if self._corr is not None else 1.0

    def host_overhead_s(self, num_seqs: int, num_tokens: int) -> float:
        """Overhead of a step over ``num_seqs`` sequences and ``num_tokens`` tokens outside the kernels, before
        any overlap: the engine's host work (fixed + per sequence + per token, + TP synchronisation) and the
        per-layer launch gaps."""
        return self.engine.host_work_s(self.gpu, num_seqs, num_tokens, self.tp) + (
            self.gpu.per_layer_overhead_s * self.model.num_layers
        )

    @property
    def step_fixed_host_s(self) -> float:
        """The host time every step pays whatever its size and TP degree, as the engine exposes it: the fixed
        host work (one GPU's) and the sync of a serial engine; only the sync of an overlapped one (its host
        work hides under the GPU). A pipeline stage pays it once (``perf.migration.stage_times``)."""
        e = self.engine
        if e.overlap:
            return e.sync_s
        return e.host_work_s(self.gpu, 0, 0, 1) + e.sync_s

    # -- operator counts -------------------------------------------------------------------------
    def _elementwise(self, tokens: float) -> dict[str, tuple[float, float]]:
        gated = self.model.arch == "llama"
        return elementwise_counts(
            tokens, self._h, self._q_r, self._kv_r, self._inter_r, self._dt, gated, self._norm_params
        )

    def kernel(self, name: str, tokens: float) -> OpCount:
        """One launch of the weight GEMM or element-wise operator ``name`` over ``tokens`` tokens (what a
        per-operator profile measures; calibration evaluates the model on exactly these shapes)."""
        if name in self._gemms:
            k, n, b = self._gemms[name]
            return self._gemm(name, float(tokens), k, n, b)
        if name == "lm_head":
            return self._gemm(name, float(tokens), self._h, self._vocab_r)
        if name not in ELEMENTWISE_OPS:
            known = ", ".join([*self._gemms, "lm_head", *ELEMENTWISE_OPS])
            raise ValueError(f"op: {name!r} is not a GEMM or element-wise operator (known: {known})")
        flops, num_bytes = self._elementwise(float(tokens))["norm" if name == "final_norm" else name]
        return OpCount(
            name, ELEMENTWISE, flops, num_bytes, float(tokens), 1, elementwise_class(name, self.model.arch)
        )

    def _gemm(self, name: str, tokens: float, k: int, n: int, bias: int = 0, repeat: int = 1) -> OpCount:
        return gemm_count(name, tokens, k, n, self._dt, bias, repeat)

    def op_counts(self, seqs: Sequence[SeqWork]) -> list[OpCount]:
        """Per-GPU work of every operator for a step over ``seqs`` (in ``OP_NAMES`` order, absent ones left out)."""
        m, dt, L = self.model, self._dt, self.model.num_layers
        tokens, sampled, pre_tokens, pre_ctx, pre_pairs, dec_seqs, dec_ctx = tally(seqs)
        if tokens == 0:
            return []
        T = float(tokens)
        ew = self._elementwise(T)

        classes = self._ew_class

        def elementwise(name: str, repeat: int, counts: str | None = None) -> OpCount:
            flops, num_bytes = ew[counts or name]
            return OpCount(name, ELEMENTWISE, flops, num_bytes, T, repeat, classes[name])

        ops = [elementwise("embedding", 1), elementwise("norm", 2 * L)]
        k, n_, b = self._gemms["qkv_proj"]
        ops.append(self._gemm("qkv_proj", T, k, n_, b, repeat=L))
        if m.arch == "llama":
            ops.append(elementwise("rope", L))
        ops.append(elementwise("kv_write", L))
        hd, heads_r, kvl, q_r = m.head_dim, self._heads_r, self._kv_token_layer_bytes, self._q_r
        if pre_tokens:
            # QK^T and PV: 2 * head_dim FLOPs each per (query, key) pair and head; KV of the context read
            # once (tiles of one head stay in L2), q read and output written.
            flops = 4.0 * hd * heads_r * pre_pairs
            num_bytes = pre_ctx * kvl + 2.0 * pre_tokens * q_r * dt
            ops.append(OpCount("attn_prefill", ATTENTION, flops, num_bytes, pre_tokens, repeat=L))
        if dec_seqs:
            flops = 4.0 * hd * heads_r * dec_ctx
            num_bytes = dec_ctx * kvl + 2.0 * dec_seqs * q_r * dt
            ops.append(OpCount("attn_decode", ATTENTION, flops, num_bytes, dec_seqs, repeat=L))
        for name in ("o_proj", "mlp_up", "activation", "mlp_down"):
            if name == "activation":
                ops.append(elementwise("activation", L))
                continue
            k, n_, b = self._gemms[name]
            ops.append(self._gemm(name, T, k, n_, b, repeat=L))
        ops.append(elementwise("residual_add", 2 * L))
        ops.append(elementwise("final_norm", 1, "norm"))
        if sampled:
            ops.append(self._gemm("lm_head", float(sampled), self._h, self._vocab_r))
        return ops

    def comm_s(self, num_tokens: int) -> float:
        """Tensor-parallel all-reduce time: two per layer (after attention and after the MLP), over the link
        (NCCL's fitted ring), or the engine's own all-reduce kernel where it has one and it is faster."""
        if self.tp == 1 or num_tokens == 0:
            return 0.0
        num_bytes = num_tokens * self._h * self._dt
        per = allreduce_time(num_bytes, self.tp, self.link)
        if self.engine.custom_allreduce_max_bytes:
            per = self.engine.allreduce_s(num_bytes, self.tp, per, self.link.name.startswith("nvlink"))
        return 2 * self.model.num_layers * per

    # -- predictions -------------------------------------------------------------------------------
    def op_times(self, seqs: Sequence[SeqWork]) -> dict[str, OpTime]:
        """Roofline of every operator (totals over layers), keyed by operator name."""
        out = {}
        for op in self.op_counts(seqs):
            t = op_time(op, self.gpu)
            f = self.correction(op.name, op.size_tokens)
            if f != 1.0:
                t = replace(t, compute_s=t.compute_s * f, memory_s=t.memory_s * f, latency_s=t.latency_s * f)
            out[op.name] = t
        return out

    def step(self, seqs: Sequence[SeqWork]) -> StepBreakdown:
        """Breakdown of a step computing ``seqs`` = [(num_new_tokens, context_len_after_step, samples)].

        Each operator's roofline winner goes to ``compute_s`` or ``memory_s``; kernel latencies and the host
        overhead (:meth:`host_overhead_s`) to ``overhead_s``; all-reduces to ``comm_s``.

        Every operator but the attention ones and the LM head depends only on the step's token count T (the LM
        head only on the sampled count), so their terms are memoised per T (:meth:`_terms_of`) and added here
        in :meth:`_step_plain`'s order, accumulator by accumulator: the same floats in the same order, so the
        same breakdown to the last bit (tests/test_cost_memo.py), at a fraction of the cost (the simulator
        evaluates it once per step)."""
        if self._step_memo is None:
            return self._step_plain(seqs)
        return self.step_tallied(len(seqs), tally(seqs))

    def decode_step(self, num_seqs: int, context_sum: int) -> StepBreakdown:
        """:meth:`step` of ``num_seqs`` sampling decodes (one new token each) whose contexts after the step sum
        to ``context_sum``, in O(1): the step depends on the decodes through these two sums only."""
        if self._step_memo is None:
            return self._step_plain(
                [(1, context_sum - (num_seqs - 1), True)] + [(1, 1, True)] * (num_seqs - 1)
            )
        return self.step_tallied(num_seqs, (num_seqs, num_seqs, 0, 0, 0.0, num_seqs, context_sum))

    def decode_step_fn(self, num_seqs: int) -> Callable[[int], float]:
        """``c -> breakdown_total_s(self.decode_step(num_seqs, c))`` for a context sum ``c``: :meth:`step_tallied`'s
        arithmetic for a decode-only step with everything that does not depend on ``c`` done once (memoised per
        ``num_seqs``; the same float operations in the same order, so the same value to the last bit), for the
        simulator's decode cohort (``Instance.cohort_run_begin``), which asks it once per step."""
        fn = self._decode_fns.get(num_seqs)
        if fn is None:
            fn = self._build_decode_fn(num_seqs)
        return fn

    def _build_decode_fn(self, n: int) -> Callable[[int], float]:
        """:meth:`decode_step_fn`'s function for ``n`` sequences, built and memoised (a function of its own: the
        closure's cells cost every call of the function that makes them, memo hits included)."""
        if self._step_memo is None or n < 1:

            def fn(ctx: int) -> float:
                return breakdown_total_s(self.decode_step(n, ctx))

        else:
            terms = self._step_memo.get(n)
            if terms is None:
                terms = self._terms_of(n)
            c_pre, m_pre, o_pre, _f, _b, o_pre_seq, post, kernels, comm_s, at = terms
            post_c, post_m, post_o, _pf, _pb = post
            hw, eng = self.gpu, self.engine
            work = eng.host_work_s(hw, n, n, self.tp)
            overhead_s = o_pre if eng.overlap else reduce(add, o_pre_seq, work + self._gaps_s)
            m, dt = self.model, self._dt
            hd, heads_r, kvl, q_r = m.head_dim, self._heads_r, self._kv_token_layer_bytes, self._q_r
            flops_per_ctx = 4.0 * hd * heads_r
            q_bytes = 2.0 * n * q_r * dt
            mem_half = hw.memory_half_bytes
            r, c_num, c_den, m_den, o = self._attn_terms("attn_decode", n, at, float(n))
            overhead_s += o
            kernels += m.num_layers
            overhead_s = reduce(add, post_o, overhead_s)
            lm = self._lm_memo.get(n)
            if lm is None:
                lm = self._lm_terms(n)
            lm_c, lm_v, o, _f, _b, k = lm
            overhead_s += o
            kernels += k
            launch = eng.launch_s(n, n, kernels)
            overlap, sync_s = eng.overlap, eng.sync_s
            three = len(post_c) == 3 and len(post_m) == 3
            pc0, pc1, pc2 = post_c if three else (0.0, 0.0, 0.0)
            pm0, pm1, pm2 = post_m if three else (0.0, 0.0, 0.0)

            def fn(ctx: int) -> float:
                a_flops = flops_per_ctx * ctx
                a_bytes = ctx * kvl + q_bytes
                c = a_flops * c_num / c_den if a_flops > 0 else 0.0
                mem = (a_bytes + mem_half) / m_den if a_bytes > 0 else 0.0
                if c > mem:
                    compute_s = c_pre + c * r
                    memory_s = m_pre
                else:
                    compute_s = c_pre
                    memory_s = m_pre + mem * r
                if three:  # reduce(add, ...) of three terms written out: the same additions in order
                    compute_s = compute_s + pc0 + pc1 + pc2
                    memory_s = memory_s + pm0 + pm1 + pm2
                else:
                    compute_s = reduce(add, post_c, compute_s)
                    memory_s = reduce(add, post_m, memory_s)
                if lm_c:
                    compute_s += lm_v
                else:
                    memory_s += lm_v
                if overlap:
                    gpu_s = compute_s + memory_s + overhead_s + comm_s
                    busy = gpu_s if gpu_s >= launch else launch
                    over = overhead_s + ((busy if busy >= work else work) - gpu_s + sync_s)
                else:
                    gpu_s = compute_s + memory_s + (overhead_s - work) + comm_s
                    over = overhead_s + ((launch - gpu_s if launch > gpu_s else 0.0) + sync_s)
                return compute_s + memory_s + over + comm_s + 0.0

        if len(self._decode_fns) >= STEP_MEMO_MAX:
            self._decode_fns.clear()
        self._decode_fns[n] = fn
        return fn

    def step_tallied(self, num_seqs: int, sums: tuple[int, int, int, int, float, int, int]) -> StepBreakdown:
        """:meth:`step` of ``num_seqs`` sequences whose :func:`tally` is ``sums`` (the memoised path): what does not
        depend on the contexts memoised per (sequences, tokens, sampled, prompt-chunk tokens, decodes)
        (:meth:`_tally_fixed`), the rest the same operations in the same order."""
        tokens, sampled, pre_tokens, pre_ctx, pre_pairs, dec_seqs, dec_ctx = sums
        if tokens == 0:
            return StepBreakdown()
        key = (num_seqs, tokens, sampled, pre_tokens, dec_seqs)
        fx = self._tally_memo.get(key)
        if fx is None:
            fx = self._tally_fixed(key)
        (compute_s, memory_s, flops, num_bytes, overhead_s, work, pre_t, dec_t, post_c, post_m, post_f, post_b,
         lm, launch, comm_s) = fx  # fmt: skip
        # _op_terms of OpCount("attn_prefill" / "attn_decode", ATTENTION, a_flops, a_bytes, ..., repeat=L), their
        # FLOP- and byte-free factors memoised: compute_time_s and memory_time_s's operations in the same order
        for t, pairs, ctx in ((pre_t, pre_pairs, pre_ctx), (dec_t, dec_ctx, dec_ctx)):
            if t is None:
                continue
            k_flops, kvl, q_bytes, mem_half, L, r, c_num, c_den, m_den = t
            a_flops = k_flops * pairs
            a_bytes = ctx * kvl + q_bytes
            c = a_flops * c_num / c_den if a_flops > 0 else 0.0
            mem = (a_bytes + mem_half) / m_den if a_bytes > 0 else 0.0
            if c > mem:
                compute_s += c * r
            else:
                memory_s += mem * r
            flops += a_flops * L
            num_bytes += a_bytes * L
        compute_s = reduce(add, post_c, compute_s)
        memory_s = reduce(add, post_m, memory_s)
        flops = reduce(add, post_f, flops)
        num_bytes = reduce(add, post_b, num_bytes)
        if lm is not None:
            to_c, v, f, b = lm
            if to_c:
                compute_s += v
            else:
                memory_s += v
            flops += f
            num_bytes += b
        eng = self.engine
        if eng.overlap:
            gpu_s = compute_s + memory_s + overhead_s + comm_s
            busy = gpu_s if gpu_s >= launch else launch
            overhead_s += (busy if busy >= work else work) - gpu_s + eng.sync_s
        else:
            gpu_s = compute_s + memory_s + (overhead_s - work) + comm_s
            overhead_s += (launch - gpu_s if launch > gpu_s else 0.0) + eng.sync_s
        return StepBreakdown(compute_s, memory_s, overhead_s, comm_s, 0.0, flops, num_bytes)

    def _tally_fixed(self, key: tuple[int, int, int, int, int]) -> tuple:
        """:meth:`step_tallied`'s values that depend on (sequences, tokens, sampled, prompt-chunk tokens,
        decodes) only, each computed as it did: the operators before attention, the overhead summed in its
        order (their latencies, the attention kernels', those after, the LM head's), the attention factors, the
        lists summed after attention, the LM head's terms, the launch time (memoised)."""
        num_seqs, tokens, sampled, pre_tokens, dec_seqs = key
        memo = self._tally_memo
        if len(memo) >= STEP_MEMO_MAX:
            memo.clear()
        terms = self._step_memo.get(tokens)
        if terms is None:
            terms = self._terms_of(tokens)
        c_pre, m_pre, o_pre, f_pre, b_pre, o_pre_seq, post, kernels, comm_s, at = terms
        post_c, post_m, post_o, post_f, post_b = post
        hw, eng = self.gpu, self.engine
        work = eng.host_work_s(hw, num_seqs, tokens, self.tp)
        # a serial engine's overhead starts from its host work, so its latencies are added one by one
        overhead_s = o_pre if eng.overlap else reduce(add, o_pre_seq, work + self._gaps_s)
        L = self.model.num_layers
        m, dt = self.model, self._dt
        hd, heads_r, kvl, q_r = m.head_dim, self._heads_r, self._kv_token_layer_bytes, self._q_r
        T = float(tokens)
        attn = []
        for name, size in (("attn_prefill", pre_tokens), ("attn_decode", dec_seqs)):
            if not size:
                attn.append(None)
                continue
            r, c_num, c_den, m_den, o = self._attn_terms(name, size, at, T)
            attn.append((4.0 * hd * heads_r, kvl, 2.0 * size * q_r * dt, hw.memory_half_bytes, L, r, c_num, c_den,
                         m_den))  # fmt: skip
            overhead_s += o
            kernels += L
        overhead_s = reduce(add, post_o, overhead_s)
        lm = None
        if sampled:
            lm_t = self._lm_memo.get(sampled)
            if lm_t is None:
                lm_t = self._lm_terms(sampled)
            to_c, v, o, f, b, k = lm_t
            lm = (to_c, v, f, b)
            overhead_s += o
            kernels += k
        launch = eng.launch_s(num_seqs, tokens, kernels)
        fx = (c_pre, m_pre, f_pre, b_pre, overhead_s, work, attn[0], attn[1], post_c, post_m, post_f, post_b, lm,
              launch, comm_s)  # fmt: skip
        memo[key] = fx
        return fx

    def _op_terms(self, op: OpCount, at: dict[str, float] | None, step_tokens: float) -> tuple:
        """What one operator adds to a step (:meth:`_step_plain`'s loop body): (to compute_s?, the roofline
        winner's time, its latency, FLOPs, bytes, launches), with the correction at ``step_tokens``."""
        r = op.repeat
        if at is not None:
            f = (
                at.get(op.name)
                if op.size_tokens == step_tokens
                else self._corr.factor(op.name, op.size_tokens)
            )
            if f is not None:
                r = r * f
        hw = self.gpu
        c = compute_time_s(op.flops, op.size_tokens, hw, op.kind)
        mem = memory_time_s(op.bytes, hw, op.kind, op.size_tokens, op.curve)
        key = op.kind, op.curve
        small = self._small
        path = small.get(key) if small else None
        if path is not None and max(op.size_tokens, 1.0) <= path[0]:
            o = path[1] * r
        else:
            o = self._latency[key] * r
        return (
            c > mem,
            (c * r if c > mem else mem * r),
            o,
            op.flops * op.repeat,
            op.bytes * op.repeat,
            op.repeat,
        )

    def _attn_terms(
        self, name: str, size_tokens: int, at: dict[str, float] | None, step_tokens: float
    ) -> tuple:
        """What :meth:`_op_terms` computes for the attention operator ``name`` over ``size_tokens`` tokens in a
        step of ``step_tokens`` whatever its FLOPs and bytes (memoised): the repeat times its correction, the
        numerator and denominator of :func:`compute_time_s` and the denominator of :func:`memory_time_s` (an
        attention kernel has no element-wise curve), and its latency."""
        key = (name, size_tokens, step_tokens if size_tokens == step_tokens else None)
        entry = self._attn_memo.get(key)
        if entry is not None:
            return entry
        if len(self._attn_memo) >= STEP_MEMO_MAX:
            self._attn_memo.clear()
        r = self.model.num_layers
        if at is not None:
            f = at.get(name) if size_tokens == step_tokens else self._corr.factor(name, size_tokens)
            if f is not None:
                r = r * f
        hw = self.gpu
        x = max(size_tokens, 1.0)
        c_eff = hw.compute_eff_max * hw.attention_eff_ratio
        m_eff = hw.memory_eff_max * hw.kv_memory_eff_ratio
        entry = (r, x + hw.compute_half_tokens, x * hw.peak_flops * c_eff, hw.mem_bandwidth_bytes_s * m_eff,
                 self._latency[(ATTENTION, "")] * r)  # fmt: skip
        self._attn_memo[key] = entry
        return entry

    def _terms_of(self, tokens: int) -> tuple:
        """The memo entry of a step of ``tokens`` tokens: the operators before attention summed from 0 in
        order (compute, memory, the overlapped engine's overhead from the layer gaps, FLOPs, bytes) and their
        latencies one by one, those after it (o_proj .. final_norm) per accumulator in order, their launches,
        the all-reduce time and the corrections at T."""
        memo = self._step_memo
        if len(memo) >= STEP_MEMO_MAX:
            memo.clear()
        T = float(tokens)
        corr = self._corr
        at = corr.at(T) if corr is not None else None
        compute_s = memory_s = flops = num_bytes = 0.0
        overhead_s = self._gaps_s
        o_seq: list[float] = []
        post: tuple[list[float], ...] = ([], [], [], [], [])
        kernels = 0
        before = True
        for op in self.op_counts([(tokens, tokens, False)]):  # one prompt chunk: every T-only operator
            if op.kind == ATTENTION:
                before = False
                continue
            to_c, v, o, f, b, k = self._op_terms(op, at, T)
            kernels += k
            if before:
                if to_c:
                    compute_s += v
                else:
                    memory_s += v
                overhead_s += o
                o_seq.append(o)
                flops += f
                num_bytes += b
            else:
                post[0 if to_c else 1].append(v)
                post[2].append(o)
                post[3].append(f)
                post[4].append(b)
        if self.tp > 1:
            kernels += 2 * self.model.num_layers  # the all-reduces
        entry = (compute_s, memory_s, overhead_s, flops, num_bytes, tuple(o_seq), tuple(tuple(x) for x in post),
                 kernels, self.comm_s(tokens), at)  # fmt: skip
        memo[tokens] = entry
        return entry

    def _lm_terms(self, sampled: int) -> tuple:
        """The LM head's terms for ``sampled`` sampling sequences (memoised per count)."""
        memo = self._lm_memo
        if len(memo) >= STEP_MEMO_MAX:
            memo.clear()
        op = self._gemm("lm_head", float(sampled), self._h, self._vocab_r)
        at = self._corr.at(float(sampled)) if self._corr is not None else None
        entry = memo[sampled] = self._op_terms(op, at, float(sampled))
        return entry

    def _step_plain(self, seqs: Sequence[SeqWork]) -> StepBreakdown:
        """:meth:`step` operator by operator, without the memo (the reference it is checked against)."""
        ops = self.op_counts(seqs)
        if not ops:
            return StepBreakdown()
        hw, eng = self.gpu, self.engine
        tokens = int(ops[0].size_tokens)  # the embedding runs over every token of the step
        num_seqs = len(seqs)
        compute_s = memory_s = flops = num_bytes = 0.0
        gaps = hw.per_layer_overhead_s * self.model.num_layers
        work = eng.host_work_s(hw, num_seqs, tokens, self.tp)
        # a serial engine's host work comes first (its sum in this order is the step time of before engine
        # profiles, bit for bit); an overlapped engine's is set against the GPU time once that is known
        overhead_s = work + gaps if not eng.overlap else gaps
        kernels = 0
        latency, small, corr = self._latency, self._small, self._corr
        at = corr.at(ops[0].size_tokens) if corr is not None else None  # factors at the step's token count
        for op in ops:  # op_time's arithmetic, inlined: this is the simulator's hot path
            r = op.repeat
            if at is not None:  # a profiled shape's measured correction scales the whole kernel
                f = (
                    at.get(op.name)
                    if op.size_tokens == ops[0].size_tokens
                    else corr.factor(op.name, op.size_tokens)
                )
                if f is not None:
                    r = r * f
            c = compute_time_s(op.flops, op.size_tokens, hw, op.kind)
            mem = memory_time_s(op.bytes, hw, op.kind, op.size_tokens, op.curve)
            if c > mem:
                compute_s += c * r
            else:
                memory_s += mem * r
            key = op.kind, op.curve
            path = small.get(key) if small else None
            if path is not None and max(op.size_tokens, 1.0) <= path[0]:
                overhead_s += path[1] * r
            else:
                overhead_s += latency[key] * r
            flops += op.flops * op.repeat
            num_bytes += op.bytes * op.repeat
            kernels += op.repeat
        comm_s = self.comm_s(tokens)
        if self.tp > 1:
            kernels += 2 * self.model.num_layers  # the all-reduces
        launch = eng.launch_s(num_seqs, tokens, kernels)
        if eng.overlap:
            gpu_s = compute_s + memory_s + overhead_s + comm_s
            busy = gpu_s if gpu_s >= launch else launch
            overhead_s += (busy if busy >= work else work) - gpu_s + eng.sync_s
        else:
            gpu_s = compute_s + memory_s + (overhead_s - work) + comm_s
            overhead_s += (launch - gpu_s if launch > gpu_s else 0.0) + eng.sync_s
        return StepBreakdown(compute_s, memory_s, overhead_s, comm_s, 0.0, flops, num_bytes)

    def gpu_step(self, seqs: Sequence[SeqWork]) -> StepBreakdown:
        """The step's GPU time alone (kernels, their latencies, per-layer gaps and all-reduces in
        ``overhead_s``/``comm_s``, no engine host time): what every engine profile starts from."""
        ops = self.op_counts(seqs)
        if not ops:
            return StepBreakdown()
        times = self.op_times(seqs)
        b = StepBreakdown(overhead_s=self.gpu.per_layer_overhead_s * self.model.num_layers)
        for t in times.values():
            if t.compute_s > t.memory_s:
                b.compute_s += t.compute_s
            else:
                b.memory_s += t.memory_s
            b.overhead_s += t.latency_s
            b.flops += t.flops
            b.bytes += t.bytes
        b.comm_s = self.comm_s(int(ops[0].size_tokens))
        return b

    def num_kernels(self, seqs: Sequence[SeqWork]) -> int:
        """Kernel launches of a step (every operator launch, and two all-reduces per layer when tp > 1)."""
        n = sum(op.repeat for op in self.op_counts(seqs))
        return n + (2 * self.model.num_layers if self.tp > 1 and n else 0)

    def host_time(self, seqs: Sequence[SeqWork], gpu_s: float | None = None) -> HostTime:
        """Where the host time of a step over ``seqs`` goes under the engine profile: its host work, launch
        and sync time, how much of it the GPU step hides and the step's duration. ``gpu_s``: the GPU time to
        set it against (default: :meth:`gpu_step`'s; an overlap-mode step model passes its own)."""
        if gpu_s is None:
            gpu_s = breakdown_total_s(self.gpu_step(seqs))
        tokens = sum(n for n, _, _ in seqs)
        return host_time(self.engine, self.gpu, gpu_s, len(seqs), tokens, self.num_kernels(seqs), self.tp)

    def step_seconds(self, seqs: Sequence[SeqWork]) -> float:
        return breakdown_total_s(self.step(seqs))

    @staticmethod
    def plan_seqs(plan: BatchPlan) -> list[SeqWork]:
        """The plan's sequences; a decode cohort (``plan.cohort_seqs``) as that many decodes with its context
        sum (a step depends on its decodes through their count and context sum only)."""
        seqs = [(s.num_new_tokens, s.context_len, s.sample) for s in plan.seqs]
        c = plan.cohort_seqs
        if c:
            seqs += [(1, plan.cohort_context - (c - 1), True)] + [(1, 1, True)] * (c - 1)
        return seqs

    def predict(self, plan: BatchPlan) -> StepBreakdown:
        """Breakdown of the compute in ``plan`` (KV transfers are the executor's business)."""
        if self._step_memo is None:
            return self._step_plain(self.plan_seqs(plan))
        shape = plan_shape(plan)
        return self.step_tallied(shape[0], shape_tally(shape))

    def cohort_chunk_step(self, plan: BatchPlan) -> StepBreakdown:
        """:meth:`predict` of a plan that is the decode cohort (``cohort_seqs``, ``cohort_context``) plus one prompt
        chunk of two or more tokens (``plan.seqs[0]``): :func:`plan_shape`'s and :func:`shape_tally`'s sums built
        from the counts and the chunk alone (the same integers and floats, in the same order), no shape tuple."""
        if self._step_memo is None:
            return self.predict(plan)
        s = plan.seqs[0]
        n = s.num_new_tokens
        ctx = s.start + n
        c = plan.cohort_seqs
        return self.step_tallied(
            1 + c,
            (
                n + c,
                (1 if s.sample else 0) + c,
                0 + n,
                0 + ctx,
                0.0 + (n * (ctx - n) + n * (n + 1) / 2),
                0 + c,
                0 + plan.cohort_context,
            ),
        )

    def step_time(self, plan: BatchPlan) -> float:
        return breakdown_total_s(self.predict(plan))

    # -- roofline crossover ---------------------------------------------------------------------------
    def gemm_bound(self, tokens: int, gemm: str = "mlp_up") -> str:
        """Whether a weight GEMM with M = ``tokens`` is "memory"- or "compute"-bound on this GPU."""
        if gemm not in self._gemms:
            raise ValueError(f"gemm: unknown {gemm!r} (known: {', '.join(self._gemms)})")
        k, n, b = self._gemms[gemm]
        return op_time(self._gemm(gemm, float(tokens), k, n, b), self.gpu).bound

    def gemm_crossover_tokens(self, gemm: str = "mlp_up", limit: int = 1 << 20) -> int:
        """Smallest token count at which ``gemm`` is compute-bound (binary search)."""
        if self.gemm_bound(limit, gemm) == "memory":
            return limit
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi) // 2
            if self.gemm_bound(mid, gemm) == "compute":
                hi = mid
            else:
                lo = mid + 1
        return lo

    def kv_transfer_bytes(self, num_tokens: int) -> int:
        """Bytes of KV this GPU holds for ``num_tokens`` tokens (all layers)."""
        return num_tokens * self.kv_bytes_per_token
