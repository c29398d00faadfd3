"""Per-step attention metadata of the paged model: slot mapping, attention groups (decodes split by
context length; one group per prefill chunk), block indices, masks. Built once per step with numpy
(:func:`build_step_metadata`) and shared by all layers of :class:`~kvbalance.model.llama.LlamaModel`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch


def attention_dtype(model_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """Dtype attention runs in: bfloat16 caches natively (the CPU kernel is ~2x faster than
    widening them), other narrow caches (float16) widened to the model's dtype after the gather."""
    return cache_dtype if cache_dtype == torch.bfloat16 else model_dtype


# -- per-step metadata ----------------------------------------------------------------------------


@dataclass
class AttnGroup:
    """Sequences whose attention runs as one padded ``scaled_dot_product_attention`` call.

    Decodes (one query each) and prefill chunks form separate groups, and decodes of very
    different context lengths are split further, so no group pads much work it does not need.
    """

    token_index: torch.Tensor | None  # [n] rows of the step's T tokens (None: all T rows, in order)
    block_index: torch.Tensor  # [B * ctx_blocks] physical blocks to gather, row-major per sequence
    bias: torch.Tensor | None  # the additive mask once built (prefill groups: at construction); see attn_bias
    query_index: torch.Tensor | None  # [B * max_q] group token for each padded query (None: decode group)
    output_index: torch.Tensor | None  # [n] padded query row of each group token (None: decode group)
    batch_size: int
    max_q: int
    ctx_blocks: int
    context_lens: torch.Tensor | None = None  # [B] int64 keys per sequence (decode groups: native kernel)
    q_start: int = 0  # prefill groups (one sequence each): position of the first new token
    context: int = 0  # prefill groups: keys the last new token attends (q_start + new tokens)
    # decode groups: the mask's inputs (keys per sequence [B], padded keys, dtype, device), built on first
    # read of attn_bias: the native decode kernel reads context_lens and never needs it
    mask_inputs: tuple[np.ndarray, int, torch.dtype, torch.device | str] | None = None

    @property
    def attn_bias(self) -> torch.Tensor | None:
        """[B, 1, G * max_q, ctx_blocks * block_size] additive mask (0 / -inf), None where nothing is masked."""
        if self.mask_inputs is not None:
            keys, padded, dtype, device = self.mask_inputs
            mask = (np.arange(padded)[None, :] < keys[:, None])[:, None, None, :]
            bias = np.where(mask, np.float32(0.0), np.float32(-np.inf))
            self.bias = None if mask.all() else torch.from_numpy(bias).to(device).to(dtype)
            self.mask_inputs = None
        return self.bias


@dataclass
class StepMetadata:
    """Everything attention needs for one step, computed once and shared by all layers.

    Tokens of all sequences are concatenated (``T`` rows, the plan's order).
    """

    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: cache slot (block * block_size + offset) of each new token
    logits_indices: torch.Tensor  # [S] rows of T that sample
    groups: list[AttnGroup]
    query_start_loc: np.ndarray  # [B + 1] cumulative new-token counts (host side, for inspection)
    context_lens: np.ndarray  # [B] tokens whose KV exists after the step
    samples_every_row: bool = False  # logits_indices is 0..T-1 (an all-decode step where every row samples)
    cos: torch.Tensor | None = None  # [T, head_dim / 2], filled by the model (in its dtype)
    sin: torch.Tensor | None = None


def _split_decodes(
    ctx: np.ndarray, rows: np.ndarray, block_size: int, max_groups: int = 4
) -> list[np.ndarray]:
    """Split decode rows (sorted by context) into at most ``max_groups`` equal-count groups when
    that cuts padded context enough to pay for the extra calls (``block_size`` per call per seq)."""
    if len(rows) < 8:
        return [rows]
    order = rows[np.argsort(ctx[rows], kind="stable")]
    best, best_cost = [rows], None
    for k in range(1, max_groups + 1):
        parts = [p for p in np.array_split(order, k) if len(p)]
        cost = sum(len(p) * int(ctx[p].max()) for p in parts) + (k - 1) * len(rows) * block_size
        if best_cost is None or cost < 0.9 * best_cost:
            best, best_cost = parts, cost
    return [np.sort(p) for p in best]


def _block_table(
    block_tables: list[list[int]], nblocks: np.ndarray, ctx: np.ndarray, block_size: int
) -> np.ndarray:
    """``[B, max blocks]`` int64: each sequence's first ``nblocks[b]`` block ids, zero-padded (one
    numpy scatter of the concatenated ids instead of a row assignment per sequence)."""
    have = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    short = np.flatnonzero(have < nblocks)
    if len(short):
        i = int(short[0])
        raise ValueError(
            f"block_ids: sequence {i} has {int(have[i])} blocks of {block_size}, needs {int(ctx[i])} tokens"
        )
    used = nblocks.tolist()
    flat = np.fromiter(
        itertools.chain.from_iterable(ids[:n] for ids, n in zip(block_tables, used)),
        dtype=np.int64,
        count=int(nblocks.sum()),
    )
    table = np.zeros((len(used), int(nblocks.max())), dtype=np.int64)
    table[np.arange(table.shape[1])[None, :] < nblocks[:, None]] = flat  # row-major: the concatenation order
    return table


def build_step_metadata(
    seq_starts: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    sample_rows: list[int],
    block_size: int,
    group_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    split_decodes: bool = True,
) -> StepMetadata:
    """Vectorised (numpy) construction of the step's index tensors.

    ``seq_starts[b]``: first new position of sequence b; ``seq_lens[b]``: its new tokens;
    ``block_tables[b]``: its physical block ids; ``sample_rows``: indices b that sample.
    ``group_size`` is query heads per KV head (masks are laid out for folded GQA queries).
    ``split_decodes``: split the decodes by context length (:func:`_split_decodes`), for a decode
    attention that pads every sequence to its group's longest context (SDPA over gathered blocks). A
    paged kernel that stops at each sequence's own length pads nothing: pass False, and the decodes stay
    one group (one kernel call a layer, and an all-decode step with no token index to scatter through).
    """

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    b = len(seq_starts)
    starts = np.asarray(seq_starts, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    ctx = starts + lens
    num_tokens = int(lens.sum())
    nblocks = (ctx + block_size - 1) // block_size
    table = _block_table(block_tables, nblocks, ctx, block_size)
    cu = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    seq_of_token = np.repeat(np.arange(b), lens)
    offset_in_seq = np.arange(num_tokens) - cu[:-1][seq_of_token]
    positions = starts[seq_of_token] + offset_in_seq
    slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size

    is_decode = lens == 1
    decodes = np.flatnonzero(is_decode)
    row_sets = [decodes] if len(decodes) else []
    if split_decodes and len(decodes):
        row_sets = _split_decodes(ctx, decodes, block_size)
    groups = []
    only_group = len(row_sets) + int((~is_decode).sum()) == 1
    for rows in row_sets:
        g_ctx = ctx[rows]
        nb = int(nblocks[rows].max())
        groups.append(
            AttnGroup(
                token_index=None if only_group else t(cu[rows]),
                block_index=t(table[rows, :nb].reshape(-1)),
                bias=None,
                mask_inputs=(g_ctx, nb * block_size, dtype, device),
                query_index=None,
                output_index=None,
                batch_size=len(rows),
                max_q=1,
                ctx_blocks=nb,
                context_lens=t(g_ctx),
            )
        )
    # Prefill chunks: one attention call each (no padding across sequences). A chunk without cached
    # prefix attends only its own new keys, causally; a chunk after a prefix gets a bottom-right mask.
    for r in np.flatnonzero(~is_decode):
        n, st, c = int(lens[r]), int(starts[r]), int(ctx[r])
        bias = None
        if st > 0:
            allowed = np.arange(c)[None, :] <= (st + np.arange(n))[:, None]
            bias = t(np.where(allowed, np.float32(0.0), np.float32(-np.inf))).to(dtype)
        groups.append(
            AttnGroup(
                token_index=None if only_group else t(np.arange(cu[r], cu[r + 1])),
                block_index=t(table[r, : int(nblocks[r])]),
                bias=bias,
                query_index=None,
                output_index=None,
                batch_size=1,
                max_q=n,
                ctx_blocks=int(nblocks[r]),
                q_start=st,
                context=c,
            )
        )
    logits_rows = cu[1:][np.asarray(sample_rows, dtype=np.int64)] - 1
    return StepMetadata(
        positions=t(positions),
        slot_mapping=t(slots),
        logits_indices=t(logits_rows),
        groups=groups,
        query_start_loc=cu,
        context_lens=ctx,
        samples_every_row=len(logits_rows) == num_tokens
        and bool((logits_rows == np.arange(num_tokens)).all()),
    )
