"""Output-length estimates refined as the job runs (``offline/refit.py``) and their use by the live admission."""

from __future__ import annotations

import numpy as np
import pytest

from kvbalance.offline.admission import DualScanAdmission
from kvbalance.offline.refit import LengthRefit, km_survival
from kvbalance.request import Request, RequestState


def test_kaplan_meier_without_censoring_is_the_empirical_distribution():
    t, s = km_survival([1, 2, 3, 4], [])
    assert list(t) == [1, 2, 3, 4] and s == pytest.approx([0.75, 0.5, 0.25, 0.0])
    rf = LengthRefit(min_events=1)
    for x in (1, 2, 3, 4):
        rf.add(x, 1)
    rf.fit([])
    assert rf.mean_ratio == pytest.approx(2.5)  # the sample mean
    assert rf.mean_above(2.5) == pytest.approx(3.5)  # the mean of {3, 4}


def test_censored_observations_move_mass_to_the_right():
    # events 1 and 3, one request known to exceed 2: mass 1/3 at 1, 2/3 at 3
    t, s = km_survival([1, 3], [2])
    assert s == pytest.approx([2 / 3, 0.0])
    rf = LengthRefit(min_events=2)
    rf.add(1, 1)
    rf.add(3, 1)
    rf.fit([2])
    assert rf.mean_ratio == pytest.approx(1 / 3 + 2)
    assert rf.mean_above(2) == pytest.approx(3.0)
    assert rf.estimate(100, produced=200) == pytest.approx(300)  # prior 100, 200 produced: ends at 3 x 100


def test_mass_past_every_observation_ends_at_the_prior_or_now():
    rf = LengthRefit(min_events=1)
    rf.add(50, 100)  # one finished at half its prior; two running at 0.8 and 0.9 of theirs
    rf.fit([0.8, 0.9])
    assert rf.mean_ratio == pytest.approx(0.5 + (2 / 3) * (1.0 - 0.5))
    assert rf.estimate(100, produced=90) == pytest.approx(100)  # expected to end at its prior
    assert rf.estimate(100, produced=120) == pytest.approx(121)  # past the prior: at least one more token


def test_the_priors_stand_until_enough_requests_finished():
    rf = LengthRefit(min_events=3)
    rf.add(10, 100)
    rf.add(10, 100)
    rf.fit([])
    assert not rf.active and rf.mean_ratio == 1.0 and rf.estimate(100) == 100
    rf.add(10, 100)
    rf.fit([])
    assert rf.active and rf.estimate(100) == pytest.approx(10)
    with pytest.raises(ValueError, match="min_events"):
        LengthRefit(min_events=0)


class _Instance:
    def __init__(self) -> None:
        from types import SimpleNamespace

        from kvbalance.scheduler.config import SchedulerConfig

        self.added: list[Request] = []
        self.scheduler = SimpleNamespace(running=[], config=SchedulerConfig(max_num_batched_tokens=2048))

    def add_request(self, req, now):
        self.added.append(req)
        return True


def _job(refit: bool):
    """20 compute-heavy requests, then 30 memory-heavy ones estimated at 4,000 output tokens (one prior, as
    from one sampled request) that really produce 1,000."""
    n_c, n_m = 20, 30
    p = np.array([600.0] * n_c + [64.0] * n_m)
    d_est = np.array([2.0] * n_c + [4000.0] * n_m)
    mem = p * d_est + d_est**2 / 2
    comp = np.where(d_est > 2, 0.01, 100.0) * mem
    reqs = [Request(f"q{i}", [1] * int(p[i]), max_tokens=2 if i < n_c else 1000) for i in range(n_c + n_m)]
    rho_root = float(comp.sum() / mem.sum())
    adm = DualScanAdmission(
        [],
        list(range(n_c + n_m)),
        p,
        d_est,
        comp,
        mem,
        rho_root,
        30_000,
        memory_rule="average",
        refit_lengths=refit,
    ).bind(reqs)
    return adm, reqs


def test_the_admission_refines_a_groups_estimates_from_its_finished_requests():
    adm, reqs = _job(refit=True)
    inst = _Instance()
    for step in range(4):  # the memory side's prefill budget releases two a step
        adm.before_step(inst, float(step))
    heavy = list(adm.live[1])
    assert len(heavy) >= 6
    assert heavy and all(adm.d[i] == 4000 for i in heavy)
    released_before = len(adm.live[1])
    for i in heavy[:3]:  # three memory-heavy requests finish at 1,000 tokens: a quarter of their prior
        reqs[i].output_token_ids = [0] * 1000
        reqs[i].state = RequestState.FINISHED
    for i in heavy[3:]:  # the others have produced 900 so far
        reqs[i].output_token_ids = [0] * 900
    adm.before_step(inst, 4.0)
    # the running ones (900 / 4,000 = 0.225, below every finished ratio, 0.25) are expected to end at 1,000
    assert all(adm.d[i] == pytest.approx(1000) for i in heavy[3:])
    pending = adm.seq[adm.left : adm.right + 1]
    assert all(adm.d[i] < 4000 for i in pending if adm.heavy[i])  # the pending ones follow the fit
    assert len(adm.live[1]) + 3 > released_before  # so more of them fit the memory share

    off, reqs2 = _job(refit=False)
    for step in range(4):
        off.before_step(_Instance(), float(step))
    for i in off.live[1][:3]:
        reqs2[i].output_token_ids = [0] * 1000
        reqs2[i].state = RequestState.FINISHED
    off.before_step(_Instance(), 4.0)
    assert all(off.d[i] == 4000 for i in off.seq if off.heavy[i])  # without it the priors stand
