"""kvbalance search: the space, the price table, the queueing bound (an upper bound that prunes nothing the
simulator accepts), the bracketing + bisection, the probe cache, and a small end-to-end search whose answer the
simulator confirms and no cheaper simulated candidate meets."""

from __future__ import annotations

import math

import pytest

from kvbalance.cli import main
from kvbalance.search.backends import ProcessBackend, SerialBackend
from kvbalance.search.bisect import Probe, ProbeCache, ProbeSettings, max_slo_rate, run_probe
from kvbalance.search.pareto import pareto_front
from kvbalance.search.prices import default_prices, gpu_price, load_prices
from kvbalance.search.prune import deployment_bound
from kvbalance.search.search import SearchSettings, confirm, run_search, sim_fields
from kvbalance.search.space import Deployment, enumerate_deployments

# Short outputs so that a run of ~15 s of arrivals reaches steady state; a small KV pool (6,144 tokens) so that
# memory binds: the queueing bound then matters at rates the simulator resolves quickly.
WORKLOAD = "uniform:100-400:10-60"
# The engine is pinned to vllm-v0 (serial A40-era host time): the case (rate 34, >= 2 deployments pruned) was
# calibrated on its step times, before the default became vllm-v1 (issue 23), whose shorter steps prune fewer.
EXTRA = {"kv_tokens": 6144, "engine": "vllm-v0"}
PROBE = ProbeSettings(ttft_slo_s=1.0, tpot_slo_s=0.1, target=0.9, duration_s=15.0, min_requests=100,
                      max_requests=1500)  # fmt: skip
GPUS = ["l40s", "a100-40gb"]


def settings(rate: float, **kw) -> SearchSettings:
    return SearchSettings("llama-2-7b", WORKLOAD, rate, PROBE, extra_sim=EXTRA, resolution=0.1, **kw)


def space():
    return enumerate_deployments(GPUS, 2, tps=(1, 2))


def full_probe(dep: Deployment, rate: float) -> Probe:
    s = settings(rate)
    full = ProbeSettings(**(PROBE.__dict__ | {"early_exit": False}))
    return run_probe(sim_fields(s, dep), dep.cluster_config().model_dump(), rate, full)


# -- space and prices -------------------------------------------------------------------------------------


def test_space_has_every_layout_of_each_gpu_budget():
    names = [d.name for d in enumerate_deployments(["h100-sxm"], 3, tps=(1, 2))]
    assert names == [
        "h100-sxm:1C:sarathi512:cap256",
        "h100-sxm:2C:sarathi512:cap256", "h100-sxm:1Ctp2:sarathi512:cap256", "h100-sxm:1P+1D:sarathi512:cap256",
        "h100-sxm:3C:sarathi512:cap256", "h100-sxm:1P+2D:sarathi512:cap256", "h100-sxm:2P+1D:sarathi512:cap256",
        "h100-sxm:1P+1Dtp2:sarathi512:cap256", "h100-sxm:1Ptp2+1D:sarathi512:cap256",
    ]  # fmt: skip
    deps = enumerate_deployments(
        ["a40"], 1, policies=("sarathi", "vllm"), chunk_sizes=(256, 512), batch_caps=(64,)
    )
    assert [(d.policy, d.chunk_size) for d in deps] == [("sarathi", 256), ("sarathi", 512), ("vllm", 256)]
    assert all(d.num_gpus == 1 and d.mode == "colocated" for d in deps)
    with pytest.raises(ValueError, match="modes: unknown"):
        enumerate_deployments(["a40"], 1, modes=("pd",))


def test_price_table_defaults_and_overrides(tmp_path):
    prices = default_prices()
    assert set(GPUS) <= set(prices) and all(v > 0 for v in prices.values())
    f = tmp_path / "p.yaml"
    f.write_text("l40s: 2.5\nmy-gpu: {usd_per_gpu_hour: 9}\n")
    over = load_prices(f)
    assert over["l40s"] == 2.5 and over["my-gpu"] == 9.0 and over["h100-sxm"] == prices["h100-sxm"]
    with pytest.raises(ValueError, match="no price for gpu 'b200'"):
        gpu_price(over, "b200")
    f.write_text("l40s: -1\n")
    with pytest.raises(ValueError, match="l40s: usd_per_gpu_hour must be a positive number"):
        load_prices(f)


def test_pareto_front_keeps_only_undominated_points():
    pts = [{"usd_per_hour": c, "goodput_rps": g, "n": n}
           for n, (c, g) in enumerate([(1, 5), (2, 4), (2, 8), (3, 8), (4, 20), (1, 3)])]  # fmt: skip
    assert [p["n"] for p in pareto_front(pts)] == [0, 2, 4]


# -- bracketing and bisection -------------------------------------------------------------------------------


def threshold_probe(threshold: float, calls: list):
    def probe(rate: float) -> Probe:
        calls.append(rate)
        return Probe(rate, rate <= threshold, 1.0 if rate <= threshold else 0.5, True, 10)

    return probe


def test_bracket_then_bisect_finds_the_threshold_within_the_resolution():
    calls: list[float] = []
    rate, status, probes = max_slo_rate(threshold_probe(13.7, calls), floor=2.0, resolution=0.05)
    assert status == "searched" and 13.7 / 1.05 <= rate <= 13.7
    assert calls[:4] == [2.0, 4.0, 8.0, 16.0] and len(probes) == len(calls)


def test_a_miss_at_the_floor_stops_at_once_and_says_why():
    calls: list[float] = []
    assert max_slo_rate(threshold_probe(1.0, calls), floor=2.0, target_rate=2.0)[:2] == (None, "misses_slo")
    assert max_slo_rate(threshold_probe(3.0, calls), floor=5.0, target_rate=2.0)[:2] == (None, "dominated")
    assert calls == [2.0, 5.0]


def test_the_bracket_never_probes_past_the_ceiling():
    calls: list[float] = []
    rate, status, _ = max_slo_rate(threshold_probe(100.0, calls), floor=2.0, ceiling=6.0)
    assert (rate, status) == (6.0, "at_ceiling") and max(calls) == 6.0
    calls.clear()
    rate, status, _ = max_slo_rate(threshold_probe(5.0, calls), floor=2.0, ceiling=6.0, resolution=0.01)
    assert status == "searched" and 5.0 / 1.01 <= rate <= 5.0 and max(calls) == 6.0


def test_probe_cache_round_trips_and_skips_torn_files(tmp_path):
    cache = ProbeCache(tmp_path)
    probes = [Probe(4.0, True, 0.95, True, 100, 3.8, 0.2, 0.03), Probe(0.1 + 0.2, False, 0.4, False, 100)]
    cache.store("k", probes)
    (tmp_path / "k" / "9.0.json").write_text("{not json")
    assert cache.load("k") == {p.rate: p for p in probes}
    assert ProbeCache(None).load("k") == {}


# -- the queueing bound -------------------------------------------------------------------------------------


def test_bound_is_above_the_saturated_throughput_and_within_a_small_factor():
    from kvbalance.cluster.config import run_cluster
    from kvbalance.sim.run import SimulateConfig
    from kvbalance.workloads.presets import build_requests

    for dep in [d for d in space() if d.name.startswith(("l40s:1C", "a100-40gb:1P+1D", "a100-40gb:1Ctp2"))]:
        s = settings(1.0)
        b = deployment_bound(dep, s.base_sim(), WORKLOAD)
        sim = SimulateConfig(**(sim_fields(s, dep) | {"rate": math.inf, "num_requests": 600}))
        reqs = build_requests(WORKLOAD, 600, math.inf, 0, 4096)
        thr = run_cluster(sim, dep.cluster_config(), reqs).summary["steady_throughput_rps"]
        assert thr <= b.mu_rps, (dep.name, thr, b.mu_rps)
        assert b.mu_rps < 3 * thr, (dep.name, thr, b.mu_rps)  # an upper bound that still prunes


def test_pruning_drops_no_deployment_the_simulator_accepts_on_an_exhaustive_case():
    rate = 34.0
    s = settings(rate)
    pruned = accepted = 0
    for dep in space():
        b = deployment_bound(dep, s.base_sim(), WORKLOAD)
        ok = full_probe(dep, rate).passed
        if rate >= b.mu_rps:
            pruned += 1
            assert not ok, f"{dep.name}: pruned (bound {b.mu_rps:.1f}) but the simulator accepts {rate}"
        accepted += ok
    assert pruned >= 2 and accepted >= 1  # the case exercises both sides


# -- the search end to end ------------------------------------------------------------------------------------


def test_search_answer_is_confirmed_and_no_cheaper_simulated_candidate_meets_the_slo(tmp_path):
    rate = 34.0
    res = run_search(space(), settings(rate), default_prices(), SerialBackend(), cache_dir=tmp_path / "c")
    best = res.best
    assert best is not None and best.goodput_rps >= rate
    assert res.counts["pruned_by_model"] >= 2 and res.counts["simulated_candidates"] >= 2
    check = confirm(res)
    assert check.exact and check.passed and check.attainment >= 0.9
    cheaper = [c for c in res.candidates if c.probes and c.usd_per_hour < best.usd_per_hour]
    assert cheaper, "the case should make the search reject a cheaper simulated candidate"
    for c in cheaper:
        assert not full_probe(c.deployment, rate).passed, c.deployment.name
    assert best in res.front and all(c.goodput_rps >= rate for c in res.front)
    costs = [c.usd_per_hour for c in res.front]
    assert costs == sorted(costs) and [c.goodput_rps for c in res.front] == sorted(
        c.goodput_rps for c in res.front
    )


def test_rerun_and_widened_grid_reuse_the_probe_cache(tmp_path):
    deps = [d for d in space() if d.gpu == "a100-40gb"]
    first = run_search(deps, settings(34.0), default_prices(), SerialBackend(), cache_dir=tmp_path)
    again = run_search(deps, settings(34.0), default_prices(), SerialBackend(), cache_dir=tmp_path)
    assert first.simulations > 0 and again.simulations == 0 and again.cached == first.simulations
    assert _same_outcome(first, again) and again.best.deployment == first.best.deployment
    wider = run_search(space(), settings(34.0), default_prices(), SerialBackend(), cache_dir=tmp_path)
    assert wider.cached > 0


def _same_outcome(a, b) -> bool:
    return [(c.deployment.name, c.status, c.goodput_rps) for c in a.candidates] == [
        (c.deployment.name, c.status, c.goodput_rps) for c in b.candidates
    ]


def test_incumbent_prunes_candidates_that_cannot_beat_it():
    deps = [d for d in space() if d.gpu == "a100-40gb"]
    res = run_search(deps, settings(10.0, wave=1), default_prices(), SerialBackend())
    assert res.counts["pruned_by_incumbent"] + res.counts["dominated"] >= 1
    for c in res.candidates:
        if c.status == "pruned_by_incumbent":
            assert not c.probes and any(o.meets_target and o.goodput_rps >= c.mu_rps and
                                        o.usd_per_hour <= c.usd_per_hour for o in res.candidates)  # fmt: skip


def test_search_is_the_same_on_the_process_pool():
    deps = [d for d in space() if d.gpu == "l40s"]
    serial = run_search(deps, settings(20.0), default_prices(), SerialBackend())
    pool = ProcessBackend(workers=2)
    try:
        parallel = run_search(deps, settings(20.0), default_prices(), pool)
    finally:
        pool.close()
    assert parallel.to_dict() == serial.to_dict()


def test_cli_search_prints_the_answer_and_writes_files(tmp_path, capsys):
    out = tmp_path / "s"
    rc = main(["search", "--workload", WORKLOAD, "--rate", "30", "--ttft-slo", "1", "--tpot-slo", "0.1",
               "--gpus", "a100-40gb", "--max-gpus", "2", "--tps", "1", "--duration", "15", "--min-requests",
               "100", "--serial", "--no-progress", "--out", str(out), "--resolution", "0.2"])  # fmt: skip
    text = capsys.readouterr().out
    assert "cheapest meeting the SLOs" in text and "pruned by the queueing model" in text
    assert rc == 0
    for f in ("search.json", "candidates.csv", "pareto.png", "goodput_vs_rate.png"):
        assert (out / f).stat().st_size > 0
    assert main(["search", "--workload", WORKLOAD, "--rate", "-1", "--ttft-slo", "1", "--tpot-slo", "0.1",
                 "--serial", "--out", str(out)]) == 2  # fmt: skip
    assert "rate: the target must be a positive" in capsys.readouterr().err
