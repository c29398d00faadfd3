"""kvbalance sweep: grid parsing and naming, one summary per point plus sweep.csv, and the same summaries on
the process pool, in-process and on a local Ray."""

from __future__ import annotations

import csv
import json
import math
import warnings

import pytest

from kvbalance.cli import main
from kvbalance.search.backends import ProcessBackend, SerialBackend, make_backend, ray_temp_dir
from kvbalance.search.sweep import (
    apply_point,
    grid_points,
    parse_grid,
    point_name,
    run_sweep,
    simulate_config,
)

BASE = {"model": "llama-2-7b", "gpu": "a100-80gb", "workload": "sharegpt", "num_requests": 30, "ttft_slo_s": 1.0,
        "tpot_slo_s": 0.1}  # fmt: skip
CLUSTER_BASE = BASE | {"cluster": {"instances": [{"role": "colocated", "count": 2}], "router": "round_robin"}}


def test_grid_values_read_as_yaml_scalars_in_axis_order():
    grid = parse_grid(["rate=2,inf", "policy=sarathi,vllm", "enable_prefix_caching=false"])
    assert grid == {"rate": [2, math.inf], "policy": ["sarathi", "vllm"], "enable_prefix_caching": [False]}
    points = grid_points(grid)
    assert [(p["rate"], p["policy"]) for p in points] == [(2, "sarathi"), (2, "vllm"), (math.inf, "sarathi"),
                                                          (math.inf, "vllm")]  # fmt: skip
    assert point_name(points[2]) == "rate=inf_policy=sarathi_enable_prefix_caching=False"


@pytest.mark.parametrize(
    "spec, field",
    [
        (["rate"], "key=v1"),
        (["=1,2"], "key=v1"),
        (["rate=1,,2"], "empty value"),
        (["rate=1", "rate=2"], "twice"),
    ],
)
def test_bad_grid_names_the_problem(spec, field):
    with pytest.raises(ValueError, match=field):
        parse_grid(spec)


def test_cluster_keys_go_into_the_cluster_section_and_need_one():
    data = apply_point(CLUSTER_BASE, {"cluster.router": "least_loaded", "rate": 3})
    assert data["cluster"]["router"] == "least_loaded" and data["rate"] == 3
    assert CLUSTER_BASE["cluster"]["router"] == "round_robin"  # the base is not modified
    with pytest.raises(ValueError, match="cluster.router needs a cluster: section"):
        apply_point(BASE, {"cluster.router": "least_loaded"})


def test_a_bad_point_is_named_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match=r"point policy=nope: policy"):
        run_sweep(BASE, {"policy": ["sarathi", "nope"]}, tmp_path, SerialBackend())
    assert not (tmp_path / "policy=sarathi").exists()


def test_sweep_writes_one_summary_per_point_and_a_csv_row_each(tmp_path):
    summaries = run_sweep(BASE, {"rate": [2.0, 50.0]}, tmp_path, SerialBackend())
    for name, s in zip(["rate=2.0", "rate=50.0"], summaries):
        assert json.loads((tmp_path / name / "summary.json").read_text()) == json.loads(json.dumps(s))
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert [r["point"] for r in rows] == ["rate=2.0", "rate=50.0"]
    assert [float(r["rate"]) for r in rows] == [2.0, 50.0]
    assert float(rows[0]["ttft_s.p90"]) < float(rows[1]["ttft_s.p90"])  # the load shows in the latency
    assert int(rows[0]["completed"]) == 30


def test_a_point_equals_the_same_config_simulated_on_its_own(tmp_path):
    s = run_sweep(CLUSTER_BASE, {"rate": [6.0]}, tmp_path, SerialBackend())[0]
    alone = simulate_config(CLUSTER_BASE | {"rate": 6.0})
    assert s == alone and s["cluster"] == "2xC" and len(s["instances"]) == 2


def test_process_pool_and_serial_give_the_same_summaries(tmp_path):
    grid = {"rate": [4.0, 16.0]}
    serial = run_sweep(CLUSTER_BASE, grid, tmp_path / "a", SerialBackend())
    pool = ProcessBackend(workers=2)
    try:
        parallel = run_sweep(CLUSTER_BASE, grid, tmp_path / "b", pool)
    finally:
        pool.close()
    assert parallel == serial
    assert serial[0] != serial[1]


def test_two_point_sweep_same_on_the_process_pool_and_on_local_ray(tmp_path):
    pytest.importorskip("ray")
    grid = {"rate": [4.0, 16.0]}
    pool = make_backend("process", workers=2)
    try:
        expected = run_sweep(CLUSTER_BASE, grid, tmp_path / "pool", pool)
    finally:
        pool.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a long pytest path moves Ray's temp dir (warned), a small /dev/shm
        ray_backend = make_backend("ray", workers=2, out_dir=tmp_path / "r")
    import ray

    try:
        got = run_sweep(CLUSTER_BASE, grid, tmp_path / "ray", ray_backend)
    finally:
        ray_backend.close()
    assert not ray.is_initialized()  # the backend shut down the Ray it started
    assert got == expected


def test_ray_temp_dir_is_under_the_output_folder_when_short_enough(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    short = tmp_path.parent / "k"
    if len(str(short / "ray")) + 70 <= 107:
        assert ray_temp_dir(short) == str(short / "ray")
    with pytest.warns(UserWarning, match="too long"):
        path = ray_temp_dir(tmp_path / ("x" * 80))
    assert "kvb-ray-" in path


def test_cli_sweep_runs_the_grid(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: llama-2-7b\nworkload: sharegpt\nnum_requests: 20\n")
    out = tmp_path / "out"
    rc = main(["sweep", str(cfg), "--grid", "rate=3,6", "--out", str(out), "--serial", "--no-progress"])
    assert rc == 0
    assert (out / "rate=3" / "summary.json").exists() and (out / "rate=6" / "summary.json").exists()
    assert "2 points on the serial backend" in capsys.readouterr().out
    assert main(["sweep", str(cfg), "--grid", "chunk_size=0", "--out", str(out), "--serial"]) == 2
