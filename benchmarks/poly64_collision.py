"""Find two token blocks with the same poly64 prefix-cache hash, by lattice reduction (prints the pair).

The poly64 content hash of a block is ``splitmix64(sum_i t_i c_i mod 2**64)`` with fixed odd coefficients
``c_i`` (``kvcache.hashing``): two blocks collide when their difference ``d`` satisfies
``sum_i d_i c_i = 0 (mod 2**64)``. Those ``d`` form a lattice of determinant ``2**64`` in ``Z**k`` (``k``
positions varied); its shortest vectors have entries of a few units (Gaussian heuristic: length about
``sqrt(k / (2 pi e)) * 2**(64 / k)``), so ``base + d`` stays a valid token block. LLL (Lenstra, Lenstra and
Lovasz 1982, exact rational arithmetic on numpy object arrays) finds such vectors in a CPU second or so for
k = 16. The chained prefix hash adds ``content * coefficient(block index)``, so a colliding block collides at
every index and the collision carries to every later block of an equal suffix.

    .venv/bin/python benchmarks/poly64_collision.py --positions 16-31 --block-size 32
"""

from __future__ import annotations

import argparse
import time
from fractions import Fraction

import numpy as np

from kvbalance.kvcache.hashing import _COEF, BlockHasher, prefix_block_hashes

MOD = 1 << 64


def lll(basis: np.ndarray, delta: Fraction = Fraction(99, 100)) -> np.ndarray:
    """LLL-reduce the rows of an integer basis (object array of Python ints); returns the reduced rows.

    The textbook algorithm: size-reduce row k against rows j < k with the Gram-Schmidt coefficients
    mu[k, j], swap rows k-1 and k when Lovasz's condition ``|b*_k|^2 >= (delta - mu^2) |b*_{k-1}|^2`` fails.
    Gram-Schmidt is exact (Fractions): updated in place by a size reduction, recomputed after a swap.
    """
    b = [list(map(int, row)) for row in basis]
    n = len(b)

    def dot(u, v):
        return sum(x * y for x, y in zip(u, v))

    def gram_schmidt():
        bstar, mu, norms = [], [[Fraction(0)] * n for _ in range(n)], []
        for i in range(n):
            v = [Fraction(x) for x in b[i]]
            for j in range(i):
                mu[i][j] = dot(b[i], bstar[j]) / norms[j]
                v = [x - mu[i][j] * y for x, y in zip(v, bstar[j])]
            bstar.append(v)
            norms.append(dot(v, v))
        return mu, norms

    mu, norms = gram_schmidt()
    k = 1
    while k < n:
        for j in range(k - 1, -1, -1):  # size reduction: |mu[k][j]| <= 1/2 (b*_k and the norms do not move)
            q = round(mu[k][j])
            if q:
                b[k] = [x - q * y for x, y in zip(b[k], b[j])]
                for i in range(j):
                    mu[k][i] -= q * mu[j][i]
                mu[k][j] -= q
        if norms[k] >= (delta - mu[k][k - 1] ** 2) * norms[k - 1]:
            k += 1
        else:
            b[k - 1], b[k] = b[k], b[k - 1]
            mu, norms = gram_schmidt()
            k = max(k - 1, 1)
    return np.array(b, dtype=object)


def collision_basis(coefs: list[int]) -> np.ndarray:
    """Rows spanning {d : sum d_i c_i = 0 mod 2**64}: (2**64, 0, ...) and (-c_i / c_0 mod 2**64, e_i)."""
    k = len(coefs)
    inv0 = pow(coefs[0], -1, MOD)  # c_0 is odd: invertible mod 2**64
    rows = [[MOD] + [0] * (k - 1)]
    for i in range(1, k):
        row = [(-coefs[i] * inv0) % MOD] + [0] * (k - 1)
        row[i] = 1
        rows.append(row)
    return np.array(rows, dtype=object)


def find_collision(block_size: int, positions: range, base: int, vocab: int) -> tuple[list[int], list[int]]:
    """Two ``block_size``-token blocks (``base`` everywhere; the second differs at ``positions``) whose
    poly64 hashes are equal: the shortest reduced vector that keeps every token in ``[0, vocab)``."""
    coefs = [int(c) for c in _COEF.positions(block_size)[list(positions)]]
    reduced = lll(collision_basis(coefs))
    for d in sorted(reduced.tolist(), key=lambda v: sum(x * x for x in v)):
        if not any(d) or not all(0 <= base + x < vocab for x in d):
            continue
        a = [base] * block_size
        b = list(a)
        for p, x in zip(positions, d):
            b[p] = base + x
        assert sum(x * c for x, c in zip(d, coefs)) % MOD == 0
        return a, b
    raise RuntimeError("no short vector keeps the tokens in the vocabulary: widen --positions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--positions", default="0-15", help="token positions the second block changes, A-B")
    ap.add_argument("--base", type=int, default=5000, help="the token repeated in the first block")
    ap.add_argument(
        "--vocab", type=int, default=49152, help="tokens must stay in [0, vocab) (SmolLM2: 49152)"
    )
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.positions.split("-"))
    if not 0 <= lo <= hi < args.block_size:
        raise SystemExit(
            f"--positions: need 0 <= A <= B < block size ({args.block_size}), got {args.positions}"
        )
    t0 = time.process_time()
    a, b = find_collision(args.block_size, range(lo, hi + 1), args.base, args.vocab)
    cpu_s = time.process_time() - t0
    ha, hb = prefix_block_hashes(a, args.block_size), prefix_block_hashes(b, args.block_size)
    print(f"block size {args.block_size}, positions {lo}-{hi}: found in {cpu_s:.2f} CPU s")
    print(f"a = [{args.base}] * {args.block_size}")
    print(
        f"b = a, plus d at positions {lo}..{hi}: d = {[y - x for x, y in zip(a[lo : hi + 1], b[lo : hi + 1])]}"
    )
    print(f"poly64: {ha[0]} {hb[0]} (equal: {ha == hb})")
    tail = [7] * args.block_size
    same = prefix_block_hashes(a + tail, args.block_size) == prefix_block_hashes(b + tail, args.block_size)
    print(f"poly64 with an equal next block: equal again: {same}")
    sha = BlockHasher("sha256")
    print(
        f"sha256: equal: {sha.prefix_block_hashes(a, args.block_size) == sha.prefix_block_hashes(b, args.block_size)}"
    )


if __name__ == "__main__":
    main()
