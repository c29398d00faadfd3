"""Block hashes that name real KV: SHA-256 / keyed BLAKE2b chains, what they cover, and the poly64 collisions
they must not share (the pair from issue 22 and one found by ``benchmarks/poly64_collision.py``)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from kvbalance.engine import InstanceConfig
from kvbalance.kvcache.hashing import (
    FAST_HASHER,
    HASH_ALGOS,
    BlockHasher,
    prefix_block_hashes,
    token_bytes,
)
from kvbalance.scheduler.config import SchedulerConfig

# issue 22: found by lattice reduction on the 16 position coefficients of a 16-token block
ISSUE_D = (2, -3, 0, -2, 6, -4, -5, -2, -2, -1, 9, -1, 9, -2, 2, -4)
# benchmarks/poly64_collision.py --block-size 64 --positions 32-47 --base 12000 (the CPU engine's block size)
OWN_D = (2, 5, -3, -2, -1, -1, 1, -2, -9, -5, -2, 8, -7, -1, 2, 1)


def issue_pair(base: int = 5000) -> tuple[list[int], list[int], int]:
    return [base] * 16, [base + d for d in ISSUE_D], 16


def own_pair(base: int = 12000) -> tuple[list[int], list[int], int]:
    a = [base] * 64
    b = a[:32] + [base + d for d in OWN_D] + a[48:]
    return a, b, 64


PAIRS = {"issue 22": issue_pair, "found here": own_pair}


@pytest.mark.parametrize("pair", PAIRS)
def test_the_pairs_collide_under_poly64_also_after_an_equal_suffix(pair):
    a, b, bs = PAIRS[pair]()
    assert a != b
    assert prefix_block_hashes(a, bs) == prefix_block_hashes(b, bs)
    tail = list(range(100, 100 + 2 * bs))
    assert prefix_block_hashes(a + tail, bs) == prefix_block_hashes(b + tail, bs)
    assert FAST_HASHER.prefix_block_hashes(a + tail, bs) == prefix_block_hashes(a + tail, bs)


def test_the_issue_pair_hashes_to_the_value_it_reported():
    a, b, bs = issue_pair()
    assert prefix_block_hashes(a, bs) == prefix_block_hashes(b, bs) == [5053242528252386817]


@pytest.mark.parametrize("algo", ["sha256", "blake2b"])
@pytest.mark.parametrize("pair", PAIRS)
def test_the_pairs_do_not_collide_under_the_cryptographic_hashes(pair, algo):
    a, b, bs = PAIRS[pair]()
    h = BlockHasher(algo)
    tail = list(range(100, 100 + 2 * bs))
    ha, hb = h.prefix_block_hashes(a + tail, bs), h.prefix_block_hashes(b + tail, bs)
    assert len(ha) == 3 and all(x != y for x, y in zip(ha, hb))


def test_default_hasher_is_sha256_everywhere_real_kv_is_named():
    assert BlockHasher().algo == "sha256"
    assert SchedulerConfig().block_hasher().algo == "sha256"
    assert InstanceConfig(kv_tokens=64).scheduler_config().block_hasher().algo == "sha256"
    a, b, bs = issue_pair()
    h = SchedulerConfig().block_hasher()
    assert h.prefix_block_hashes(a, bs) != h.prefix_block_hashes(b, bs)


def test_sha256_chain_follows_its_definition():
    """hash(0) = SHA-256(root || int64 LE tokens), hash(i) = SHA-256(hash(i-1) || tokens of block i)."""
    h = BlockHasher("sha256", salt="s", model="m")

    def framed(*parts: bytes) -> bytes:
        return b"".join(len(p).to_bytes(8, "little") + p for p in parts)

    root = hashlib.sha256(framed(b"kvbalance-prefix-cache-v1", b"sha256", b"2", b"m", b"s")).digest()
    h0 = hashlib.sha256(root + struct.pack("<2q", 7, -1)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<2q", 2**40, 0)).digest()
    assert h.root(2) == int.from_bytes(root, "big")
    assert h.prefix_block_hashes([7, -1, 2**40, 0, 5], 2) == [int.from_bytes(x, "big") for x in (h0, h1)]


def test_blake2b_chain_is_keyed_by_the_salt():
    key = b"deployment-secret"
    h = BlockHasher("blake2b", salt=key.decode())
    root = h.root(2).to_bytes(32, "big")
    want = hashlib.blake2b(root + struct.pack("<2q", 1, 2), digest_size=32, key=key).digest()
    assert h.prefix_block_hashes([1, 2], 2) == [int.from_bytes(want, "big")]
    assert BlockHasher("blake2b", salt="x" * 100).prefix_block_hashes([1, 2], 2) != h.prefix_block_hashes(
        [1, 2], 2
    )


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_salt_and_model_enter_every_hash(algo):
    toks = list(range(32))
    base = BlockHasher(algo).prefix_block_hashes(toks, 8)
    assert BlockHasher(algo).prefix_block_hashes(toks, 8) == base  # deterministic: same seed, same names
    for other in (BlockHasher(algo, salt="tenant-a"), BlockHasher(algo, model="llama-3-8b|bfloat16")):
        hashes = other.prefix_block_hashes(toks, 8)
        assert all(x != y for x, y in zip(hashes, base))
    assert BlockHasher(algo, salt="a").prefix_block_hashes(toks, 8) != BlockHasher(
        algo, model="a"
    ).prefix_block_hashes(toks, 8)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_chains_extend_incrementally_and_numpy_hashes_like_lists(algo):
    h = BlockHasher(algo, salt="s")
    toks = [int(x) for x in np.random.default_rng(0).integers(0, 50_000, 100)]
    full = h.prefix_block_hashes(toks, 8)
    assert len(full) == 12
    assert h.prefix_block_hashes(toks, 8, 5, full[4]) == full[5:]
    assert h.prefix_block_hashes(toks, 8, 5, full[4], 7) == full[5:7]
    assert h.prefix_block_hashes(toks, 8, 0, 12345) == full  # block 0 always starts at the root
    assert h.prefix_block_hashes(np.array(toks), 8) == full
    assert h.prefix_block_hashes(toks[:7], 8) == []
    changed = list(toks)
    changed[43] += 1  # block 5
    other = h.prefix_block_hashes(changed, 8)
    assert other[:5] == full[:5] and all(x != y for x, y in zip(other[5:], full[5:]))


def test_cryptographic_digests_are_256_bit_ints_and_poly64_fits_uint64():
    for algo in ("sha256", "blake2b"):
        hashes = BlockHasher(algo).prefix_block_hashes(list(range(64)), 16)
        assert all(isinstance(x, int) and 0 <= x < 1 << 256 for x in hashes)
        assert max(hashes) >= 1 << 64  # the whole digest is kept, not a truncation to 64 bits
    fast = BlockHasher("poly64").prefix_block_hashes(list(range(64)), 16)
    assert np.asarray(fast, dtype=np.uint64).tolist() == fast  # the offline planner stores them so


def test_block_size_enters_the_root():
    h = BlockHasher()
    assert h.root(16) != h.root(64) and h.root(16) == BlockHasher().root(16)


def test_token_bytes_are_fixed_width_little_endian_int64():
    assert token_bytes([1, -1]) == struct.pack("<2q", 1, -1)
    assert token_bytes(np.array([1, 2], dtype=np.int32)) == struct.pack("<2q", 1, 2)
    assert token_bytes(range(3)) == struct.pack("<3q", 0, 1, 2)
    with pytest.raises(struct.error):
        token_bytes([1 << 63])


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo: must be one of sha256, blake2b, poly64"):
        BlockHasher("md5")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        SchedulerConfig(prefix_caching_hash_algo="xxhash")
    with pytest.raises(ValueError, match="prefix_caching_salt"):
        SchedulerConfig(prefix_caching_salt=3)
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        InstanceConfig(kv_tokens=64, prefix_caching_hash_algo="crc32").scheduler_config()
