"""Block hashing for the prefix cache: the chained hash that names a block by the whole token prefix ending
with it, so comparing two prompts block by block is comparing two lists of ints.

:class:`BlockHasher` is what names real KV (the engine's prefix cache, the server, the offline runner, the
global KV store): ``prefix_caching_hash_algo`` (vLLM's name) picks

* ``sha256`` (the default): block i's hash is ``SHA-256(hash(i - 1) || tokens of block i)`` over fixed-width
  int64 tokens, the chain starting from a root digest of the hasher's identity (format version, algorithm,
  block size, the model, a per-deployment salt), so two blocks share a name only if their whole prefixes,
  the model and the salt are equal — unless SHA-256 collides;
* ``blake2b``: the same chain through BLAKE2b-256 keyed with the salt (a secret salt makes names
  unpredictable to clients);
* ``poly64``: the fast non-cryptographic hash below, for the simulator and planners that only count hits
  (synthetic tokens, no KV). It is linear mod 2**64 in the tokens, so short colliding blocks are found by
  lattice reduction (``benchmarks/poly64_collision.py``): never name real KV with it.

A digest is a Python int (all 256 bits), a dict key like any other. ``benchmarks/bench_hashing.py`` prints
each algorithm's cost per block.

The poly64 hash: a block's content hash is a splitmix64-mixed polynomial of its tokens (one fixed
pseudo-random coefficient per position); a prefix hash is the running sum of content hashes times
per-block-index coefficients (mod 2**64), so one hash also names all its ancestors and extending a prompt's
hashes costs only the new blocks. The module-level ``prefix_block_hashes`` / ``request_block_hashes`` are
this hash (their callers — the router's prefix index, the offline planner's tree with its uint64 arrays —
compare names only).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

HASH_ALGOS = ("sha256", "blake2b", "poly64")
CRYPTOGRAPHIC_HASH_ALGOS = ("sha256", "blake2b")
DEFAULT_HASH_ALGO = "sha256"
_FORMAT = b"kvbalance-prefix-cache-v1"
_DIGEST_BYTES = 32

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
    """Chained poly64 hashes of full blocks ``[start_block, end_block)``: hash i names tokens ``[0, (i+1)*bs)``.

    ``prev_hash`` is the hash of block ``start_block - 1`` (0 at the start). Content hash of a block is a
    mixed polynomial of its tokens; the prefix hash is the running sum of block hashes times per-index
    coefficients (mod 2**64), so extending a prompt's hashes costs only the new blocks. Not collision
    resistant (see the module docstring): for names that are only compared, never for real KV.
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
    """The request's chained poly64 block hashes over its first ``num_tokens`` tokens.

    ``cached`` holds the hashes computed so far for this request (its owner, the KV cache manager, keeps
    one list per request); only blocks past them are hashed, and they are appended to it.
    """
    return _extend_request_hashes(prefix_block_hashes, request, block_size, num_tokens, cached)


def _extend_request_hashes(
    prefix_hashes: Callable, request, block_size: int, num_tokens: int, cached: list[int]
) -> list[int]:
    want = num_tokens // block_size
    have = len(cached)
    if want > have:
        n_prompt = request.num_prompt_tokens
        prev = cached[-1] if have else 0
        if want * block_size <= n_prompt:
            cached.extend(prefix_hashes(request.prompt_token_ids, block_size, have, prev, want))
        else:
            # only the blocks past ``have`` are read: pad the front so block indices line up
            lo = have * block_size
            toks = _Offset(request.token_ids(lo, want * block_size), lo)
            cached.extend(prefix_hashes(toks, block_size, have, prev, want))
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


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Tokens as fixed-width little-endian int64 (what a block hash covers and the cache keeps per block)."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype("<i8", copy=False).tobytes()
    if not isinstance(tokens, (list, tuple)):
        tokens = list(tokens)
    n = len(tokens)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = struct.Struct(f"<{n}q")
        if len(_PACKERS) < 256:
            _PACKERS[n] = packer
    return packer.pack(*tokens)


_PACKERS: dict[int, struct.Struct] = {}  # token_bytes' packers per token count (one block's, a few chunks')


def _salt_bytes(salt: str | bytes) -> bytes:
    return salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)


def _framed(*parts: bytes) -> bytes:
    """Length-prefixed concatenation: no two different part lists frame to the same bytes."""
    return b"".join(len(p).to_bytes(8, "little") + p for p in parts)


@dataclass(frozen=True)
class BlockHasher:
    """Names KV blocks by a chained hash of their prefixes (see the module docstring).

    ``algo`` is one of :data:`HASH_ALGOS`; ``salt`` a per-deployment salt (blocks hashed under different
    salts never match; with ``blake2b`` it is the key); ``model`` the model whose KV the blocks hold. Both
    enter the root of every chain, so they are covered by every block's hash.
    """

    algo: str = DEFAULT_HASH_ALGO
    salt: str | bytes = ""
    model: str = ""
    _roots: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.algo not in HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo: must be one of {', '.join(HASH_ALGOS)}, got {self.algo!r}"
            )
        if not isinstance(self.salt, (str, bytes)):
            raise ValueError(f"prefix_caching_salt: must be a string, got {type(self.salt).__name__}")
        if not isinstance(self.model, str):
            raise ValueError(f"model: must be a string, got {type(self.model).__name__}")
        if self.algo == "blake2b":
            key = _salt_bytes(self.salt)
            if len(key) > hashlib.blake2b.MAX_KEY_SIZE:  # a longer salt keys by its digest
                key = hashlib.sha256(key).digest()
            object.__setattr__(self, "_key", key)

    @property
    def cryptographic(self) -> bool:
        return self.algo in CRYPTOGRAPHIC_HASH_ALGOS

    def root(self, block_size: int) -> int:
        """The parent hash of block 0: a digest of what this hasher is (0 for poly64 without salt or model)."""
        r = self._roots.get(block_size)
        if r is None:
            ident = _framed(
                _FORMAT,
                self.algo.encode(),
                str(block_size).encode(),
                self.model.encode(),
                _salt_bytes(self.salt),
            )
            if self.algo == "poly64":
                r = (
                    0
                    if not (self.salt or self.model)
                    else int.from_bytes(hashlib.sha256(ident).digest()[:8], "big")
                )
            else:
                r = int.from_bytes(self._digest(ident), "big")
            self._roots[block_size] = r
        return r

    def _digest(self, data: bytes) -> bytes:
        if self.algo == "sha256":
            return hashlib.sha256(data).digest()
        return hashlib.blake2b(data, digest_size=_DIGEST_BYTES, key=self._key).digest()

    def prefix_block_hashes(
        self,
        tokens: Sequence[int] | np.ndarray,
        block_size: int,
        start_block: int = 0,
        prev_hash: int = 0,
        end_block: int | None = None,
    ) -> list[int]:
        """Chained hashes of full blocks ``[start_block, end_block)``: hash i names tokens ``[0, (i+1)*bs)``.

        ``prev_hash`` is the hash of block ``start_block - 1`` (ignored at block 0: the chain starts at
        :meth:`root`). The same arguments as the module-level poly64 function.
        """
        n_full = len(tokens) // block_size if end_block is None else end_block
        if n_full <= start_block:
            return []
        if start_block == 0:
            prev_hash = self.root(block_size)
        if self.algo == "poly64":
            return prefix_block_hashes(tokens, block_size, start_block, prev_hash, n_full)
        return self._chain(
            token_bytes(tokens[start_block * block_size : n_full * block_size]), block_size, prev_hash
        )

    def token_bytes_hashes(self, data: bytes, block_size: int, start_block: int, prev_hash: int) -> list[int]:
        """:meth:`prefix_block_hashes` of the full blocks ``data`` holds (tokens as :func:`token_bytes`), which
        are blocks ``start_block``, ``start_block + 1``, ... of their sequence: for a caller that has the bytes."""
        width = 8 * block_size
        n = len(data) // width
        if n == 0:
            return []
        if start_block == 0:
            prev_hash = self.root(block_size)
        if self.algo == "poly64":
            tokens = _Offset(np.frombuffer(data, dtype="<i8", count=n * block_size), start_block * block_size)
            return prefix_block_hashes(tokens, block_size, start_block, prev_hash, start_block + n)
        return self._chain(data[: n * width], block_size, prev_hash)

    def _chain(self, buf: bytes, block_size: int, prev_hash: int) -> list[int]:
        """The chained digests of the blocks of ``buf`` (whole blocks of tokens as bytes) after ``prev_hash``."""
        width = 8 * block_size
        parent = prev_hash.to_bytes(_DIGEST_BYTES, "big")
        out: list[int] = []
        from_bytes = int.from_bytes
        if self.algo == "sha256":
            sha = hashlib.sha256
            for off in range(0, len(buf), width):
                parent = sha(parent + buf[off : off + width]).digest()
                out.append(from_bytes(parent, "big"))
        else:
            base = hashlib.blake2b(digest_size=_DIGEST_BYTES, key=self._key)
            for off in range(0, len(buf), width):
                h = base.copy()
                h.update(parent + buf[off : off + width])
                parent = h.digest()
                out.append(from_bytes(parent, "big"))
        return out

    def request_block_hashes(self, request, block_size: int, num_tokens: int, cached: list[int]) -> list[int]:
        """The request's chained block hashes over its first ``num_tokens`` tokens (extending ``cached``)."""
        return _extend_request_hashes(self.prefix_block_hashes, request, block_size, num_tokens, cached)


FAST_HASHER = BlockHasher("poly64")
