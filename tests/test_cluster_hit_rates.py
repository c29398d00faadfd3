"""Prefix-cache hit ratios of a cluster run stay in [0, 1] for every system (a P/D request is admitted twice)."""

from __future__ import annotations

import pytest

from kvbalance.cluster.config import run_cluster
from kvbalance.cluster.systems import SYSTEMS, system_config
from kvbalance.sim.run import SimulateConfig
from kvbalance.workloads.presets import build_requests

WORKLOAD = "docqa:3:512:16-48:8-24:1.0"  # three hot documents: every role's cache holds them
SPLIT = (2, 2, 1, 1)
N = 32


def _run(system: str):
    sim = SimulateConfig(
        model="llama-2-7b", gpu="a100-80gb", workload=WORKLOAD, rate=30.0, num_requests=N, seed=4
    )
    reqs = build_requests(WORKLOAD, N, 30.0, 4, 4096)
    return run_cluster(sim, system_config(system, 4, SPLIT), reqs)


@pytest.mark.parametrize("system", SYSTEMS)
def test_hit_ratios_are_fractions_for_every_system(system):
    res = _run(system)
    s = res.summary
    assert s["completed"] == N
    for key in ("prefix_hit_rate", "store_hit_rate", "decode_local_hit_rate"):
        v = s[key]
        assert v is None or 0.0 <= v <= 1.0, (key, v)
    assert s["prefix_hit_rate"] > 0.3  # the documents are shared: most of each prompt hits somewhere
    if res.cluster.pd is not None:
        # the decode side caches the documents too (earlier hand-offs): its hits are counted apart, so the
        # computed-prompt ratio is not inflated by a second admission of the same prompt
        assert s["decode_local_hit_rate"] > 0.3
        reqs = res.run.requests
        pooled = sum(r.prefix_hit_tokens for r in reqs) / sum(r.num_prompt_tokens for r in reqs)
        assert pooled > 1.0 >= s["prefix_hit_rate"]  # both admissions' hits over the prompt once: over 1
