"""The BanaServe reproduction's machinery on a 2-GPU cluster and a tiny phase-shifting load: every system runs,
rows carry their keys, per-phase rates and the controller trace come back, the README and plots are written,
and a rerun into the same folder keeps what is there."""

from __future__ import annotations

import json

import pytest

import kvbalance.reproduce.banaserve as bana
from kvbalance.cluster.systems import SYSTEMS

TINY = bana.Setting("phases", "phases-tiny", "phases:2:600-800:4-8:16-32:40-60:2", "poisson", "llama-2-7b", 1.0,
                    0.1, (3.0, 3.0), (12, 40), 8.0)  # fmt: skip


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(bana, "NUM_GPUS", 2)
    monkeypatch.setattr(bana, "SETTINGS", [TINY])
    monkeypatch.setattr(bana, "CURVE_FACTORS", (1.0,))


def test_reproduction_runs_every_system_and_writes_its_report(two_gpus, tmp_path):
    res = bana.run(tmp_path, quick=True)
    rows = json.loads((tmp_path / "results.json").read_text())
    ran = set(SYSTEMS) - set(bana.SKIP["phases"])
    assert res["rows"] == len(rows) == len(ran) and {r["system"] for r in rows} == ran
    for r in rows:
        assert r["max_rate_at_slo_rps"] > 0 and r["hot_spot_ratio"] >= 1 and r["config"]
        assert r["group"] == "phases" and r["workload"] == "phases-tiny"
    by = {r["system"]: r for r in rows}
    assert "policy=vllm engine=vllm-v0" in by["vllm-v0"]["config"]
    assert "migration=role flips" in by["banaserve"]["config"]
    assert "migration=layer+attention" in by["banaserve-paper"]["config"]
    assert len(by["banaserve"]["per_phase_max_rate_rps"]) == 2
    series = json.loads((tmp_path / "series.json").read_text())  # the time series, beside the rows
    assert not any(k in r for r in rows for k in bana.SERIES_KEYS)
    assert series[bana._row_key(by["banaserve"])]["controller_trace"]["reason"]
    joined = {bana._row_key(r): r for r in bana.join_series(rows, series)}
    assert series and all(joined[k].items() >= v.items() for k, v in series.items())
    meta = json.loads((tmp_path / "meta.json").read_text())
    note = meta["settings"][TINY.key]
    assert set(note["curves"]) == set(bana.MAIN) and len(note["curves"]["vllm"]) == 1
    assert {"round_robin", "kv_aware", "store_aware (kvbalance)"} <= set(note["router_hot_spot"])
    assert len(note["best_static_per_phase"]) == 2 and note["split"] == [1, 1, 1, 1]
    text = (tmp_path / "README.md").read_text()
    assert "1.2-3.9x" in text and "migration_share_max_rate" in text and "Best static split per phase" in text
    assert "Checks (issue 24)" in text and "b_banaserve_vs_best_static_run" in text and "Measured at" in text
    for png in ("max_rate.png", "curves.png", "utilization.png", "controller.png", "hot_spot.png",
                "slo_attainment.png", "migrations.png"):  # fmt: skip
        assert (tmp_path / png).stat().st_size > 0
    again = bana.run(tmp_path, quick=True)  # the setting is there: nothing reruns
    assert again["simulated_runs"] == res["simulated_runs"]
    assert json.loads((tmp_path / "results.json").read_text()) == rows
    assert json.loads((tmp_path / "series.json").read_text()) == series  # read back with the rows, kept


def test_settings_filter_runs_only_the_named_ones_and_keeps_the_rest(monkeypatch, tmp_path):
    import kvbalance.reproduce.banaserve_report as report

    other = bana.Setting("reuse", "docqa-tiny", "docqa-zipf", "poisson", "llama-2-7b", 0.5, 0.1, (1.0, 1.0),
                         (10, 20), 8.0)  # fmt: skip
    monkeypatch.setattr(bana, "SETTINGS", [TINY, other])
    ran = []

    def fake(st, quick, split, tick):
        ran.append(st.key)
        return (
            [{"model": st.model, "workload": st.name, "arrival": st.arrival, "system": "vllm"}],
            (1, 1, 1, 1),
            {"split": [1, 1, 1, 1]},
        )

    monkeypatch.setattr(bana, "_one_setting", fake)
    monkeypatch.setattr(report, "write_plots", lambda *a: None)
    monkeypatch.setattr(report, "write_readme", lambda *a: None)
    with pytest.raises(ValueError, match="unknown settings"):
        bana.run(tmp_path, quick=True, settings=("nope",))
    bana.run(tmp_path, quick=True, settings=("docqa-tiny",))
    assert ran == [other.key]
    bana.run(tmp_path, quick=True, settings=(TINY.key,))  # by key; the first one is kept
    assert ran == [other.key, TINY.key]
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert set(meta["settings"]) == {TINY.key, other.key} and "code" in meta["settings"][TINY.key]
    assert len(json.loads((tmp_path / "results.json").read_text())) == 2


def test_checks_of_issue_24_by_hand():
    from kvbalance.reproduce.banaserve_report import checks

    def row(system, rate, **kw):
        return {"model": "m", "workload": "phases-15", "arrival": "poisson", "system": system,
                "max_rate_at_slo_rps": rate, "prefix_hit_rate": 0.5, **kw}  # fmt: skip

    group = [row("vllm", 10.0), row("kvbalance", 11.0), row("distserve", 8.0),
             row("banaserve", 10.0, per_phase_max_rate_rps=[5.0, 12.0])]  # fmt: skip
    c = checks(group, {"best_static_per_phase": [4.0, 12.5]})
    assert c["a_met"] and c["a_needed"] == 1.0 and abs(c["a_kvbalance_vs_vllm"] - 1.1) < 1e-12
    assert c["b_banaserve_vs_best_static_per_phase"] == [1.25, 12.0 / 12.5] and not c["b_met"]
    assert c["b_banaserve_vs_best_static_run"] == 1.25 and c["c_met"]
    docqa = [dict(r, workload="docqa-zipf") for r in group[:2]]
    assert checks(docqa, {})["a_needed"] == 1.2 and not checks(docqa, {})["a_met"]
    assert not checks([row("vllm", 1.0), row("kvbalance", 1.0, store_hit_rate=1.5)], {})["c_met"]
