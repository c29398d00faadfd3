"""What ``reproduce blendserve`` runs for a choice of experiments and systems (no simulation: fast)."""

import pytest

from kvbalance.reproduce import blendserve


def _runs(planners):
    return [
        (w[0], w[5], w[7])
        for w in blendserve._plan_work(blendserve.QUICK, ["main", "no-host"], ["trace1"], planners)
    ]


def test_planners_limit_the_main_experiment_and_name_its_ablations():
    every = _runs(None)
    assert len(every) == len(blendserve.PAPER_SYSTEMS) + len(blendserve.ABLATIONS) + 2
    assert _runs(["vllm-dfs", "blendserve"]) == [
        ("main", "vllm-dfs", "default"),
        ("main", "blendserve", "default"),
        ("no-host", "nanoflow-dfs", "no-host"),  # the no-host pair is always both
        ("no-host", "blendserve", "no-host"),
    ]
    ablations = _runs(["ablations"])
    assert [r[1:] for r in ablations if r[0] == "main"] == [(p, v) for p, _, v in blendserve.ABLATIONS]


def test_unknown_planner_is_refused(tmp_path):
    with pytest.raises(ValueError, match="planners: unknown 'dfs'"):
        blendserve.run(tmp_path, quick=True, experiments=["main"], planners=["dfs"])
