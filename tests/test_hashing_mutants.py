"""The prefix-hash coefficients, pinned to their formulas and growth rule on a fresh table.

The module's ``_COEF`` table is filled once per process, so only a fresh ``_HashCoefficients`` shows what
its methods compute: position coefficients ``splitmix64(i * 0x2545F4914F6CDD1D) | 1`` for i = 1..block_size,
block-index coefficients ``splitmix64(j ^ 0xD6E8FEB86659FD93) | 1`` for j = 0.., grown to
``max(n, 2 * current, 1024)`` entries when more are asked for. The pure-Python ``_splitmix64_int`` is the
reference (the same bits as the vectorised one).
"""

from __future__ import annotations

import numpy as np

from kvbalance.kvcache.hashing import _HashCoefficients, _splitmix64_int

_M64 = (1 << 64) - 1


def _position(i: int) -> int:
    return _splitmix64_int((i * 0x2545F4914F6CDD1D) & _M64) | 1


def _block(j: int) -> int:
    return _splitmix64_int(j ^ 0xD6E8FEB86659FD93) | 1


def test_position_coefficients_follow_the_formula_and_are_memoised_per_block_size():
    coef = _HashCoefficients()
    got = coef.positions(5)
    assert got.dtype == np.uint64 and got.tolist() == [_position(i) for i in range(1, 6)]
    assert coef.positions(5) is got
    assert coef.positions(2).tolist() == [_position(1), _position(2)]
    assert all(c % 2 == 1 for c in got.tolist())


def test_block_coefficients_follow_the_formula_and_grow_by_doubling_from_1024():
    coef = _HashCoefficients()
    assert coef.blocks(0).tolist() == [] and len(coef._blk) == 0
    first = coef.blocks(3)
    assert first.dtype == np.uint64 and first.tolist() == [_block(j) for j in range(3)]
    assert len(coef._blk) == 1024
    table = coef._blk
    assert len(coef.blocks(1024)) == 1024 and coef._blk is table  # enough already: no regrowth
    grown = coef.blocks(1500)
    assert len(grown) == 1500 and len(coef._blk) == 2048  # doubled
    assert grown[1499] == _block(1499) and grown[:3].tolist() == first.tolist()
    big = coef.blocks(5000)
    assert len(big) == 5000 and len(coef._blk) == 5000 and big[4999] == _block(4999)
