"""Systems as cluster configs, DistServe's split enumeration, the SLO-rate search and `simulate`'s cluster: section."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError

from kvbalance.cli import main
from kvbalance.cluster.config import ClusterConfig
from kvbalance.cluster.systems import distserve_splits, max_rate_at_slo, system_config


def test_distserve_splits_use_the_whole_budget():
    assert list(distserve_splits(8, (1,))) == [(p, 8 - p, 1, 1) for p in range(1, 8)]
    splits = list(distserve_splits(8, (1, 2)))
    assert all(p * tp_p + d * tp_d == 8 and p >= 1 and d >= 1 for p, d, tp_p, tp_d in splits)
    assert (2, 2, 2, 2) in splits and (3, 1, 2, 2) in splits and (2, 3, 1, 2) in splits
    assert len(splits) == len(set(splits))


def test_max_rate_at_slo_brackets_the_threshold_rate():
    seen = []

    def attainment(r):  # 90% of requests meet the SLO up to 37 req/s
        seen.append(r)
        return 1.0 if r <= 37.0 else 0.5

    rate, probes = max_rate_at_slo(attainment, 8.0, iters=6)
    assert rate <= 37.0 < rate + 32.0 / 2**6 + 1e-9  # doubling 8 -> 64 brackets it, then 6 halvings
    assert [r for r, _ in probes] == seen
    zero, _ = max_rate_at_slo(lambda r: 0.0, 8.0, max_doublings=3)
    assert zero == 0.0


def test_systems_are_the_configs_their_papers_describe():
    split = (3, 5, 1, 1)
    v = system_config("vllm", 8, split, "kv_aware")
    assert (
        [(g.role, g.count) for g in v.instances] == [("colocated", 8)]
        and v.router == "kv_aware"
        and v.store is None
    )
    d = system_config("distserve", 8, split)
    assert [(g.role, g.count) for g in d.instances] == [("prefill", 3), ("decode", 5)] and d.store is None
    b = system_config("banaserve", 8, split)
    assert b.router == "load_aware" and b.store is not None and b.store.high_watermark == 0.95
    assert system_config("banaserve-no-store", 8, split).store is None
    assert system_config("banaserve-cache-aware", 8, split).router == "cache_aware"
    assert all(c.num_gpus == 8 for c in (v, d, b))
    lx = system_config("llumnix", 8, split)
    assert lx.instances == v.instances and lx.router == "llumnix" and lx.llumnix is not None
    with pytest.raises(ValueError, match="system"):
        system_config("orca", 8, split)


def test_cluster_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="router"):
        ClusterConfig(router="fastest")
    with pytest.raises(ValidationError, match="migration"):
        ClusterConfig(migration={"threshold": 0.2})
    with pytest.raises(ValidationError, match="prefill instances need decode"):
        ClusterConfig(instances=[{"role": "prefill"}])
    with pytest.raises(ValidationError, match="extra"):
        ClusterConfig(instances=[{"role": "decode", "gpus": 3}])


def test_simulate_with_a_cluster_section_prints_instance_rows(tmp_path, capsys):
    cfg = {
        "model": "llama-2-7b", "workload": "uniform:16-200:8-64", "rate": 30, "num_requests": 80,
        "cluster": {"instances": [{"role": "prefill", "count": 1}, {"role": "decode", "count": 2}],
                    "router": "load_aware", "store": {"capacity_gb": 8}},
    }  # fmt: skip
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["simulate", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "prefill-0" in text and "decode-2" in text and "hot-spot ratio" in text
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["completed"] == 80 and s["unfinished"] == 0 and s["pd_transfers"] == 80
    assert [r["role"] for r in s["instances"]] == ["prefill", "decode", "decode"]
    assert sum(r["requests"] for r in s["instances"] if r["role"] == "decode") == 80
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**cfg, "cluster": {"router": "fastest"}}))
    assert main(["simulate", str(bad), "--out", str(tmp_path / "o2"), "--no-progress"]) != 0
    assert "cluster.router" in capsys.readouterr().err
