"""Block hashing for the prefix cache: the chained hash that names a block by the whole token prefix ending
with it, so comparing two prompts block by block is comparing two lists of ints.

A block's content hash is a splitmix64-mixed polynomial of its tokens (one fixed pseudo-random coefficient
per position); a prefix hash is the running sum of content hashes times per-block-index coefficients
(mod 2**64), so one hash also names all its ancestors and extending a prompt's hashes costs only the new
blocks. ``prefix_block_hashes`` hashes a token list; ``request_block_hashes`` extends a request's cached list.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser: a non-linear 64-bit mix (wrapping uint64 arithmetic)."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


class _HashCoefficients:
    """Fixed pseudo-random coefficients: one per position in a block, one per block index."""

    def __init__(self) -> None:
        self._pos: dict[int, np.ndarray] = {}
        self._blk = np.zeros(0, dtype=np.uint64)

    def positions(self, block_size: int) -> np.ndarray:
        c = self._pos.get(block_size)
        if c is None:
            c = _splitmix64(np.arange(1, block_size + 1, dtype=np.uint64) * _U64(0x2545F4914F6CDD1D)) | _U64(
                1
            )
            self._pos[block_size] = c
        return c

    def blocks(self, n: int) -> np.ndarray:
        if n > len(self._blk):
            m = max(n, 2 * len(self._blk), 1024)
            self._blk = _splitmix64(np.arange(m, dtype=np.uint64) ^ _U64(0xD6E8FEB86659FD93)) | _U64(1)
        return self._blk[:n]


_COEF = _HashCoefficients()


_M64 = (1 << 64) - 1


def _splitmix64_int(x: int) -> int:
    """Pure-Python twin of :func:`_splitmix64` (same bits), for hashing one or two blocks cheaply."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _few_block_hashes(tokens, block_size: int, start_block: int, prev_hash: int, n_full: int) -> list[int]:
    pos = _COEF.positions(block_size).tolist()
    blk = _COEF.blocks(n_full).tolist()
    out = []
    h = prev_hash
    for b in range(start_block, n_full):
        chunk = tokens[b * block_size : (b + 1) * block_size]
        if isinstance(chunk, np.ndarray):
            chunk = chunk.tolist()
        acc = 0
        for t, c in zip(chunk, pos):
            acc += t * c
        h = (h + _splitmix64_int(acc & _M64) * blk[b]) & _M64
        out.append(h)
    return out


def prefix_block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    start_block: int = 0,
    prev_hash: int = 0,
    end_block=None,
) -> list[int]:
    """Chained hashes of full blocks ``[start_block, end_block)``: hash i names tokens ``[0, (i+1)*bs)``.

    ``prev_hash`` is the hash of block ``start_block - 1`` (0 at the start). Content hash of a block is a
    mixed polynomial of its tokens; the prefix hash is the running sum of block hashes times per-index
    coefficients (mod 2**64), so extending a prompt's hashes costs only the new blocks.
    """
    n_full = len(tokens) // block_size if end_block is None else end_block
    if n_full <= start_block:
        return []
    if n_full - start_block <= 2:
        return _few_block_hashes(tokens, block_size, start_block, prev_hash, n_full)
    arr = np.asarray(tokens[start_block * block_size : n_full * block_size], dtype=np.int64)
    blocks = arr.astype(np.uint64).reshape(-1, block_size)
    content = _splitmix64((blocks * _COEF.positions(block_size)).sum(axis=1, dtype=np.uint64))
    terms = content * _COEF.blocks(n_full)[start_block:]
    hashes = np.cumsum(terms, dtype=np.uint64) + _U64(prev_hash)
    return hashes.tolist()


def request_block_hashes(request, block_size: int, num_tokens: int, cached: list[int]) -> list[int]:
    """The request's chained block hashes over its first ``num_tokens`` tokens.

    ``cached`` holds the hashes computed so far for this request (its owner, the KV cache manager, keeps
    one list per request); only blocks past them are hashed, and they are appended to it.
    """
    want = num_tokens // block_size
    have = len(cached)
    if want > have:
        n_prompt = request.num_prompt_tokens
        prev = cached[-1] if have else 0
        if want * block_size <= n_prompt:
            cached.extend(prefix_block_hashes(request.prompt_token_ids, block_size, have, prev, want))
        else:
            # only the blocks past ``have`` are read: pad the front so block indices line up
            lo = have * block_size
            toks = _Offset(request.token_ids(lo, want * block_size), lo)
            cached.extend(prefix_block_hashes(toks, block_size, have, prev, want))
    return cached if want == len(cached) else cached[:want]


class _Offset:
    """A token list that starts at position ``offset`` (reads below it are never made)."""

    __slots__ = ("tokens", "offset")

    def __init__(self, tokens: list[int], offset: int) -> None:
        self.tokens = tokens
        self.offset = offset

    def __len__(self) -> int:
        return self.offset + len(self.tokens)

    def __getitem__(self, s: slice):
        return self.tokens[s.start - self.offset : s.stop - self.offset]
