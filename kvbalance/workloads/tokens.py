"""Synthetic token ids for simulation: prompts share tokens exactly where the workload says they share a prefix.

A ``SyntheticPrompt`` is generated lazily. Positions covered by prefix blocks take ids derived from the block's
identity (Mooncake's ``hash_ids``): ``SHARED_BASE + h * block_tokens + i % block_tokens``, so two prompts with
the same leading identities have the same leading tokens (a partial last block too). Every other position is
``UNIQUE_BASE + uid * 2**20 + i``, unique to the request. The two ranges never overlap, so the prefix cache
sees real sharing and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import overload

import numpy as np

SHARED_BASE = 1 << 32  # shared-block ids: [SHARED_BASE, UNIQUE_BASE)
UNIQUE_BASE = 1 << 40  # per-request ids: UNIQUE_BASE + uid * 2**20 + position
UID_STRIDE = 1 << 20  # longest synthetic prompt (positions of a unique tail stay below it)
MAX_UID = (np.iinfo(np.int64).max - UNIQUE_BASE) // UID_STRIDE - 1
MOONCAKE_BLOCK_TOKENS = 512


class SyntheticPrompt(Sequence):
    """A prompt of ``length`` tokens: ``shared_len`` identity-derived tokens, then a tail unique to ``uid``.

    ``hash_ids[k]`` is the identity of the k-th ``block_tokens``-token block; ``shared_len`` defaults to all
    the blocks given (capped at ``length``), so a Mooncake prompt with ceil(L / 512) ids is shared end to end.
    Indexing with an int returns an int; a slice returns an int64 array computed for that slice only.
    """

    __slots__ = ("hash_ids", "length", "uid", "block_tokens", "shared_len")

    def __init__(
        self,
        length: int,
        uid: int,
        hash_ids: Sequence[int] | np.ndarray | None = None,
        block_tokens: int = MOONCAKE_BLOCK_TOKENS,
        shared_len: int | None = None,
    ) -> None:
        if (
            isinstance(length, bool)
            or not isinstance(length, (int, np.integer))
            or not 1 <= length <= UID_STRIDE
        ):
            raise ValueError(f"length: must be an int in [1, {UID_STRIDE}], got {length!r}")
        if isinstance(uid, bool) or not isinstance(uid, (int, np.integer)) or not 0 <= uid <= MAX_UID:
            raise ValueError(f"uid: must be an int in [0, {MAX_UID}], got {uid!r}")
        if (
            isinstance(block_tokens, bool)
            or not isinstance(block_tokens, (int, np.integer))
            or block_tokens < 1
        ):
            raise ValueError(f"block_tokens: must be an int >= 1, got {block_tokens!r}")
        ids = np.asarray([] if hash_ids is None else hash_ids, dtype=np.int64)
        if ids.ndim != 1 or (len(ids) and ids.min() < 0):
            raise ValueError("hash_ids: must be a flat sequence of ints >= 0")
        if len(ids) and int(ids.max()) * block_tokens + block_tokens > UNIQUE_BASE - SHARED_BASE:
            raise ValueError(
                f"hash_ids: identity {int(ids.max())} is too large for {block_tokens}-token blocks"
            )
        covered = min(int(length), len(ids) * int(block_tokens))
        if shared_len is None:
            shared_len = covered
        elif not 0 <= shared_len <= covered:
            raise ValueError(
                f"shared_len: must be in [0, {covered}] (blocks given, capped at length), got {shared_len}"
            )
        self.hash_ids = ids
        self.length = int(length)
        self.uid = int(uid)
        self.block_tokens = int(block_tokens)
        self.shared_len = int(shared_len)

    def __len__(self) -> int:
        return self.length

    def _ids(self, pos: np.ndarray) -> np.ndarray:
        out = UNIQUE_BASE + self.uid * UID_STRIDE + pos
        shared = pos < self.shared_len
        if shared.any():
            p = pos[shared]
            h = self.hash_ids[p // self.block_tokens]
            out[shared] = SHARED_BASE + h * self.block_tokens + p % self.block_tokens
        return out

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> np.ndarray: ...

    def _range(self, a: int, b: int) -> np.ndarray:
        """Tokens of positions [a, b) (a <= b): shared blocks built per block, not per position."""
        out = np.arange(
            UNIQUE_BASE + self.uid * UID_STRIDE + a, UNIQUE_BASE + self.uid * UID_STRIDE + b, dtype=np.int64
        )
        end = min(b, self.shared_len)
        if a < end:
            bt = self.block_tokens
            first, last = a // bt, (end - 1) // bt
            base = SHARED_BASE + self.hash_ids[first : last + 1] * bt
            runs = (base[:, None] + np.arange(bt, dtype=np.int64)[None, :]).reshape(-1)
            out[: end - a] = runs[a - first * bt : end - first * bt]
        return out

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step == 1:
                return self._range(start, max(start, stop))
            return self._ids(np.arange(start, stop, step, dtype=np.int64))
        i = int(index)
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(f"SyntheticPrompt index {index} out of range for length {self.length}")
        if i < self.shared_len:
            b = self.block_tokens
            return SHARED_BASE + int(self.hash_ids[i // b]) * b + i % b
        return UNIQUE_BASE + self.uid * UID_STRIDE + i

    def __iter__(self):
        return iter(self.to_array().tolist())

    def to_array(self) -> np.ndarray:
        """The whole prompt as an int64 array (materialises it)."""
        return self[:]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = self.to_array()
        return arr if dtype is None else arr.astype(dtype)

    def tolist(self) -> list[int]:
        return self.to_array().tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SyntheticPrompt):
            return self.length == other.length and bool(np.array_equal(self.to_array(), other.to_array()))
        return NotImplemented

    __hash__ = None  # compared by content, so not hashable (like a numpy array)

    def __repr__(self) -> str:
        return (
            f"SyntheticPrompt(length={self.length}, uid={self.uid}, shared_len={self.shared_len}, "
            f"blocks={len(self.hash_ids)}x{self.block_tokens})"
        )


def unique_prompt(uid: int, length: int) -> SyntheticPrompt:
    """A prompt sharing nothing with any other uid."""
    return SyntheticPrompt(length, uid)


def shared_prefix_prompt(
    group: int, system_tokens: int, question_tokens: int, uid: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> SyntheticPrompt:
    """A prompt of group ``group``'s ``system_tokens``-token system prompt followed by a unique question.

    Prompts of the same group share exactly ``system_tokens`` leading tokens; different groups share none.
    """
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 0:
        raise ValueError(f"group: must be an int >= 0, got {group!r}")
    if (
        isinstance(system_tokens, bool)
        or not isinstance(system_tokens, (int, np.integer))
        or system_tokens < 0
    ):
        raise ValueError(f"system_tokens: must be an int >= 0, got {system_tokens!r}")
    if (
        isinstance(question_tokens, bool)
        or not isinstance(question_tokens, (int, np.integer))
        or question_tokens < 0
    ):
        raise ValueError(f"question_tokens: must be an int >= 0, got {question_tokens!r}")
    nblocks = math.ceil(system_tokens / block_tokens)
    # identities of group g are g*nblocks .. g*nblocks + nblocks - 1: disjoint across groups
    ids = np.arange(group * nblocks, (group + 1) * nblocks, dtype=np.int64)
    return SyntheticPrompt(system_tokens + question_tokens, uid, ids, block_tokens, shared_len=system_tokens)


def random_token_prompt(rng: np.random.Generator, length: int, vocab_size: int, low: int = 0) -> list[int]:
    """``length`` uniform token ids in [low, vocab_size) for a real model (set ``low`` to skip special ids)."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"length: must be an int >= 1, got {length!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size <= low:
        raise ValueError(f"vocab_size: must be an int > low ({low}), got {vocab_size!r}")
    return rng.integers(low, vocab_size, size=length).tolist()
