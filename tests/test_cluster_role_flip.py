"""Role flips (cluster/role_flip.py through the migration controller): a whole instance moves between prefill and
decode when one role is short; nothing moves on a balanced load; no block or request is lost."""

from __future__ import annotations

import pytest

from kvbalance.cluster.adaptive import MigrationSection
from kvbalance.cluster.config import ClusterConfig, InstanceGroup, build_cluster, run_cluster
from kvbalance.cluster.role_flip import MemberSignal, RoleFlipConfig, RoleFlipPolicy
from kvbalance.request import RequestState
from kvbalance.sim.run import SimulateConfig
from kvbalance.workloads.presets import build_requests


def sig(name, role, util, queue_s=0.0, requests=1, flippable=True, credit=1.0):
    return MemberSignal(name, role, util, queue_s, requests, flippable, credit)


def test_policy_flips_the_idlest_decode_instance_when_prompts_queue():
    p = RoleFlipPolicy(RoleFlipConfig(), ttft_slo_s=1.0)
    members = [sig("p0", "prefill", 1.6, 2.0), sig("p1", "prefill", 1.4, 1.0),
               sig("d0", "decode", 0.3, requests=9), sig("d1", "decode", 0.2, requests=3)]  # fmt: skip
    d, s = p.decide(10.0, members)
    assert (d.action, d.member) == ("to_prefill", "d1")
    assert s.prefill_util == pytest.approx(1.5) and s.prefill_queue_s == pytest.approx(1.5)
    p.flipped(10.0)
    assert p.decide(10.5, members)[0].reason.startswith("cooling down")
    assert p.decide(11.0, members)[0].action == "to_prefill"


def test_policy_flips_a_prefill_instance_when_decode_is_short_and_prefill_keeps_up():
    p = RoleFlipPolicy(RoleFlipConfig(), ttft_slo_s=1.0)
    members = [sig("p0", "prefill", 0.2, 0.3), sig("p1", "prefill", 0.1, 0.0), sig("p2", "prefill", 0.2),
               sig("d0", "decode", 0.95), sig("d1", "decode", 0.9)]  # fmt: skip
    d, _ = p.decide(0.0, members)
    assert (d.action, d.member) == ("to_decode", "p1")  # the least queued
    # the prefill side would not keep up with one instance fewer: peak 0.9 -> max(0.9 x 3/2, ...) is worse
    busy = [sig("p0", "prefill", 0.9), sig("p1", "prefill", 0.9), sig("p2", "prefill", 0.9),
            sig("d0", "decode", 0.95), sig("d1", "decode", 0.9)]  # fmt: skip
    d, _ = p.decide(0.0, busy)
    assert d.action == "none" and d.reason.startswith("no flip lowers the peak enough")
    # decode within its limits (pressure under decode_start_util): no flip to decode, however idle prefill is
    # (evening out would leave it holding answers when prompts come back)
    within = [sig("p0", "prefill", 0.1), sig("p1", "prefill", 0.1), sig("p2", "prefill", 0.1),
              sig("d0", "decode", 0.85), sig("d1", "decode", 0.8)]  # fmt: skip
    d, _ = p.decide(0.0, within)
    assert d.action == "none"


def test_a_decode_instance_full_of_residents_counts_for_what_they_leave_and_its_hand_offs_go_to_the_others():
    """After a decode-heavy period every decode instance still holds long answers: a flipped one gives prompts
    only the share of its steps its residents leave, and the others take the hand-offs it would have taken.
    Counting it as a whole prefill instance and the others at their present pressure (the prediction
    before) flipped five instances in 4 s on phases-15 and left one decode instance for every hand-off."""
    p = RoleFlipPolicy(RoleFlipConfig(), ttft_slo_s=1.0)
    busy = [sig("p0", "prefill", 1.3, 1.0), sig("p1", "prefill", 1.3, 1.0),
            sig("d0", "decode", 0.8, requests=110, credit=0.5), sig("d1", "decode", 0.8, requests=120, credit=0.5),
            sig("d2", "decode", 0.8, requests=115, credit=0.5)]  # fmt: skip
    # no new hand-offs: the flip pays, but only by the half instance it adds (1.3 x 2 / 2.5, not 1.3 x 2 / 3)
    d, _ = p.decide(0.0, busy, handoff_util=0.0)
    assert (d.action, d.member) == ("to_prefill", "d0") and "-> 1.04" in d.reason
    # hand-offs worth 0.5 of each decode instance: the two left would carry 0.8 + 0.5 / 2, past 1
    d, _ = p.decide(0.0, busy, handoff_util=0.5)
    assert d.action == "none" and d.reason.startswith("the decode instances left would be short (1.05")
    # with residents gone the same flip counts a whole instance again
    drained = [x if x.role == "prefill" else sig(x.name, "decode", 0.3, requests=5) for x in busy]
    d, _ = p.decide(0.0, drained, handoff_util=0.5)
    assert d.action == "to_prefill" and "-> 0.87" in d.reason


def test_policy_leaves_a_light_or_balanced_load_and_keeps_one_of_each_role():
    p = RoleFlipPolicy(RoleFlipConfig(), ttft_slo_s=1.0)
    light = [sig("p0", "prefill", 0.4), sig("d0", "decode", 0.5), sig("d1", "decode", 0.3)]
    assert p.decide(0.0, light)[0].reason.startswith("both roles keep up")
    balanced = [sig("p0", "prefill", 0.8), sig("p1", "prefill", 0.8), sig("d0", "decode", 0.8),
                sig("d1", "decode", 0.8)]  # fmt: skip
    d, _ = p.decide(0.0, balanced)
    assert d.action == "none" and d.reason.startswith("no flip lowers the peak enough")
    overloaded = [sig("p0", "prefill", 1.9, 4.0), sig("p1", "prefill", 1.9, 4.0), sig("d0", "decode", 1.1),
                  sig("d1", "decode", 1.0)]  # fmt: skip
    assert p.decide(0.0, overloaded)[0].reason.startswith("both roles short")
    last = [sig("p0", "prefill", 2.0, 3.0), sig("d0", "decode", 0.1)]
    assert p.decide(0.0, last)[0].action == "none"  # min_per_role: the only decode instance stays
    engaged = [
        sig("p0", "prefill", 2.0, 3.0),
        sig("d0", "decode", 0.1),
        sig("d1", "decode", 0.1, flippable=False),
    ]
    assert p.decide(0.0, engaged)[0].action == "to_prefill"
    assert p.decide(0.0, engaged)[0].member == "d0"  # d1 is in a move: never flipped
    with pytest.raises(ValueError, match="min_per_role"):
        RoleFlipConfig(min_per_role=0)


# a small KV pool (16k tokens per instance) makes decode memory-bound at test sizes
SIM = dict(model="llama-2-7b", gpu="a100-80gb", seed=5, ttft_slo_s=1.0, tpot_slo_s=0.1, kv_tokens=16000)
PD = ClusterConfig(
    instances=[InstanceGroup(role="prefill", count=2), InstanceGroup(role="decode", count=2)],
    router="load_aware",
    migration=MigrationSection(role_flip=True, moves=False),
)


def _run(workload: str, rate: float, n: int, cfg: ClusterConfig = PD):
    sim = SimulateConfig(workload=workload, rate=rate, num_requests=n, **SIM)
    return run_cluster(sim, cfg, build_requests(workload, n, rate, sim.seed, 4096), check_invariants=True)


def test_prompt_heavy_load_flips_decode_instances_to_prefill_and_finishes_everything():
    res = _run("uniform:1500-2000:4-16", 25.0, 100)
    s = res.summary
    assert s["completed"] == 100 and s["unfinished"] == 0
    assert s["role_flips"] >= 1 and all(
        f["from"] == "decode" and f["to"] == "prefill" for f in s["role_log"][:1]
    )
    tr = s["controller_trace"]
    assert "to_prefill" in tr["action"] and len(tr["t_s"]) == len(tr["reason"]) == len(tr["util"])
    assert max(n for n in tr["num_prefill"] if n is not None) >= 3
    # nothing leaked: every pool is whole again once the run drained (the invariants held after every step)
    for m in res.cluster.members:
        assert m.instance.scheduler.kv_used_tokens == 0
    assert all(r.state is RequestState.FINISHED for r in res.run.requests)
    # and it pays: the same load on the static 2P + 2D split meets fewer SLOs
    static = _run("uniform:1500-2000:4-16", 25.0, 100, PD.model_copy(update={"migration": None}))
    assert s["slo_attainment"] > static.summary["slo_attainment"] + 0.1


def test_decode_heavy_load_flips_prefill_instances_to_decode():
    # at 50 req/s the two decode instances meet every SLO (decode pressure peaks at 0.85) and nothing flips
    res = _run("uniform:16-64:200-300", 80.0, 160)
    s = res.summary
    assert s["completed"] == 160
    assert any(f["to"] == "decode" for f in s["role_log"])


def test_a_light_load_flips_nothing_and_same_seed_gives_the_same_run():
    a = _run("uniform:64-256:16-64", 4.0, 60)
    assert a.summary["role_flips"] == 0
    assert set(a.summary["controller_trace"]["reason"]) <= {
        r for r in a.summary["controller_trace"]["reason"] if r.startswith(("both roles keep up", "cooling"))
    }
    b = _run("uniform:1500-2000:4-16", 25.0, 60)
    c = _run("uniform:1500-2000:4-16", 25.0, 60)
    assert b.summary["role_log"] == c.summary["role_log"] and b.summary["role_flips"] > 0
    assert [r.finish_s for r in b.run.requests] == [r.finish_s for r in c.run.requests]


def test_set_role_refuses_the_last_of_a_role_and_colocated_members():
    sim = SimulateConfig(workload="fixed:16:4", rate=1.0, num_requests=1, **SIM)
    one = ClusterConfig(instances=[InstanceGroup(role="prefill"), InstanceGroup(role="decode")])
    cluster = build_cluster(sim, one)
    with pytest.raises(ValueError, match="last prefill"):
        cluster.set_role(cluster.members[0], "decode")
    colo = build_cluster(sim, ClusterConfig(instances=[InstanceGroup(count=2)]))
    with pytest.raises(ValueError, match="only prefill <-> decode"):
        colo.set_role(colo.members[0], "decode")


def test_the_controller_credits_busy_decode_instances_partly_and_counts_the_hand_offs_to_come():
    """What the controller hands the policy: a decode instance holding requests gives a flip only part of a
    prefill instance (its residents' decode step comes with every chunk), an empty one all of it; the
    hand-offs to come are counted from the requests arriving, before any prefill finishes."""
    sim = SimulateConfig(workload="uniform:16-64:200-300", rate=50.0, num_requests=80, **SIM)
    cluster = build_cluster(sim, PD)
    seen = []
    decide = cluster.migration.flips.decide

    def spy(now, members, handoff_util=0.0):
        seen.append((now, list(members), handoff_util))
        return decide(now, members, handoff_util)

    cluster.migration.flips.decide = spy
    cluster.run(build_requests("uniform:16-64:200-300", 80, 50.0, sim.seed, 4096))
    credits = [(m.requests, m.prefill_credit) for _, ms, _ in seen for m in ms if m.role == "decode"]
    assert all(c == 1.0 for n, c in credits if n == 0)
    busy = [c for n, c in credits if n > 20]
    assert busy and all(0.0 < c < 1.0 for c in busy)
    # the first tick: requests queue on the prefill instances, none was handed off yet, and they count
    now, members, handoff_util = seen[0]
    assert all(m.requests == 0 for m in members if m.role == "decode") and handoff_util > 0.0
