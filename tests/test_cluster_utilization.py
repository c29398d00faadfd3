"""busy_fraction_series (vectorised) against the window-by-window overlap it stands for."""

from __future__ import annotations

import math
import random

import pytest

from kvbalance.cluster.utilization import busy_fraction_series


def _overlap_per_window(starts, durations, t_end, window):
    n = max(1, math.ceil(t_end / window))
    return [
        sum(max(0.0, min(s + d, (i + 1) * window) - max(s, i * window)) for s, d in zip(starts, durations))
        / window
        for i in range(n)
    ]


@pytest.mark.parametrize("seed", range(5))
def test_busy_series_equals_the_overlap_of_each_window(seed):
    rng = random.Random(seed)
    t, starts, durations = 0.0, [], []
    for _ in range(rng.randint(1, 60)):
        t += rng.random() * 0.3  # idle gap, then a step: steps never overlap on one instance
        d = rng.random() * 0.5
        starts.append(t)
        durations.append(d)
        t += d
    end, window = t * rng.uniform(0.5, 1.2), rng.choice([0.1, 0.37, 1.0])
    order = list(range(len(starts)))
    rng.shuffle(order)  # any order in
    _, f = busy_fraction_series([starts[i] for i in order], [durations[i] for i in order], end, window)
    assert f.tolist() == pytest.approx(_overlap_per_window(starts, durations, end, window), abs=1e-9)
    _, none = busy_fraction_series([], [], 2.0, 1.0)
    assert none.tolist() == [0.0, 0.0]
