"""Resident drain (cluster/resident_drain.py): a decode instance flipped to prefill hands its running decodes,
KV and all, to decode instances with room; blocks are conserved, every request finishes, nothing moves
where nothing needs to or nothing fits. And the what-if phase oracle (cluster/whatif_phase_oracle.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbalance.cluster.adaptive import MigrationSection
from kvbalance.cluster.config import ClusterConfig, InstanceGroup, build_cluster, run_cluster
from kvbalance.cluster.request_migration import block_bytes
from kvbalance.cluster.resident_drain import Room, place
from kvbalance.cluster.whatif_phase_oracle import PhaseOracle
from kvbalance.request import RequestState
from kvbalance.sim.run import SimulateConfig
from kvbalance.workloads.presets import build_requests

SIM = dict(model="llama-2-7b", gpu="a100-80gb", seed=5, ttft_slo_s=1.0, tpot_slo_s=0.1, kv_tokens=16000)
DECODE_HEAVY = "uniform:16-64:200-300"


def _cfg(decode: int = 2, **mig) -> ClusterConfig:
    return ClusterConfig(
        instances=[InstanceGroup(role="prefill", count=1), InstanceGroup(role="decode", count=decode)],
        router="load_aware",
        migration=MigrationSection(role_flip=True, moves=False, drain_residents=True, **mig),
    )


# the load policy never flips by itself (peak below 100): the test flips by hand
HELD = dict(flip_start_util=100.0)


def _whole(m) -> bool:
    """Every block of ``m``'s pool is free or cached and idle: none held by a request or a transfer."""
    inst = m.instance
    idle = inst.cache.evictable_blocks if inst.cache is not None else 0
    return inst.scheduler.kv_used_tokens == 0 and inst.pool.num_used == idle


def _crafted(workload: str, n: int, rate: float, flip_at: float, cfg: ClusterConfig, sim_over=None):
    """Run ``n`` requests; at ``flip_at`` decode-0 flips to prefill and its residents drain."""
    sim = SimulateConfig(workload=workload, rate=rate, num_requests=n, **(SIM | (sim_over or {})))
    cluster = build_cluster(sim, cfg, check_invariants=True)
    d0 = next(m for m in cluster.members if m.role == "decode")
    seen = {}

    def flip():
        seen["residents"] = {r.request_id for r in cluster.migration.drain.residents(d0)}
        cluster.set_role(d0, "prefill", "test")
        seen["batches"] = cluster.migration.drain.drain(d0)

    cluster.loop.at(flip_at, flip)
    reqs = build_requests(workload, n, rate, sim.seed, 4096)
    run = cluster.run(reqs)
    return cluster, run, d0, seen


def test_a_flipped_instance_hands_its_residents_to_the_decode_instance_with_room_and_every_block_comes_back():
    cluster, run, d0, seen = _crafted(DECODE_HEAVY, 60, 30.0, 1.5, _cfg(**HELD))
    d1 = next(m for m in cluster.members if m.role == "decode")
    batches = seen["batches"]
    assert seen["residents"] and len(batches) == 1 and batches[0].dst is d1
    b = batches[0]
    moved = [rid for rid in seen["residents"] if cluster.decode_assignment[rid] == d1.index]
    assert b.moved == len(moved) > 5 and b.moved + sum(b.dropped.values()) == len(seen["residents"])
    # they went on decoding where they landed, with their outputs; nothing left half-moved
    by_id = {r.request_id: r for r in run.requests}
    assert all(by_id[rid].state is RequestState.FINISHED for rid in moved)
    assert all(by_id[rid].num_output_tokens == by_id[rid].max_tokens for rid in moved)
    assert not cluster.migration.drain.active and all(r.state is RequestState.FINISHED for r in run.requests)
    # blocks conserved: the invariants held after every step, and every pool is whole once the run drained
    assert all(_whole(m) for m in cluster.members)
    # the link's cost: every computed block crossed once at least, and the pause took time
    assert b.bytes_moved >= sum(
        d0.instance.pool.blocks_for_tokens(by_id[rid].num_prompt_tokens) for rid in moved
    ) * block_bytes(d0)
    assert b.end_s > b.stop_s >= b.start_s


def test_free_copies_take_no_time_and_the_same_seed_gives_the_same_run():
    free = _crafted(DECODE_HEAVY, 60, 30.0, 1.5, _cfg(drain_free=True, **HELD))[3]["batches"][0]
    assert free.end_s == free.stop_s
    a_cluster, a, _, a_seen = _crafted(DECODE_HEAVY, 60, 30.0, 1.5, _cfg(**HELD))
    b_cluster, b, _, b_seen = _crafted(DECODE_HEAVY, 60, 30.0, 1.5, _cfg(**HELD))
    assert [x.as_dict() for x in a_seen["batches"]] == [x.as_dict() for x in b_seen["batches"]]
    assert [r.finish_s for r in a.requests] == [r.finish_s for r in b.requests]


def test_nothing_moves_where_nothing_fits():
    # one decode instance left, already holding as much as its pool takes at the end of its answers
    cluster, run, d0, seen = _crafted(DECODE_HEAVY, 60, 30.0, 1.5, _cfg(**HELD), {"kv_tokens": 6000})
    assert seen["residents"]
    moved = sum(b.moved for b in seen["batches"])
    assert moved < len(seen["residents"])  # some stayed on the flipped instance and finished there
    assert all(r.state is RequestState.FINISHED for r in run.requests)
    assert all(_whole(m) for m in cluster.members)


def _room(kv_free, slots, contexts=()):
    cm = SimpleNamespace(step_seconds=lambda seqs: 0.001 * len(seqs))
    member = SimpleNamespace(
        index=len(contexts) + kv_free, instance=SimpleNamespace(executor=SimpleNamespace(cost_model=cm))
    )
    return Room(member, kv_free, slots, list(contexts))


def _req(rid, prompt, max_tokens, out):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, max_tokens=max_tokens, num_output_tokens=out,
                           num_tokens=prompt + out)  # fmt: skip


def test_placement_respects_kv_at_the_end_of_the_answers_slots_and_the_step_time():
    rs = [_req("a", 100, 400, 10), _req("b", 100, 200, 150), _req("c", 100, 300, 0)]
    roomy, tight = _room(10_000, 10), _room(450, 10)
    out = place(rs, [roomy, tight], tpot_slo_s=0.1)
    # longest remaining answer first, each to the most room: all three on the roomy one (tight takes none:
    # a's end is 500 tokens, c's 400 fits but roomy has more room)
    assert {k: v is roomy.member for k, v in out.items()} == {"a": True, "b": True, "c": True}
    assert roomy.kv_free_tokens == 10_000 - 500 - 300 - 400
    # KV at the end counts, not what is held now: 299 tokens free take none of these (b ends at 300)
    assert place(rs, [_room(299, 10)], 0.1) == {}
    # slots
    assert len(place(rs, [_room(10_000, 2)], 0.1)) == 2
    # step time: 0.001 s per request, 0.8 x TPOT = 0.08 s: a room with 79 requests takes one more
    full = _room(10_000, 200, [50] * 79)
    assert len(place(rs, [full], 0.1)) == 1


def test_a_balanced_load_moves_nothing():
    sim = SimulateConfig(workload="uniform:64-256:16-64", rate=4.0, num_requests=60, **SIM)
    res = run_cluster(sim, _cfg(), build_requests("uniform:64-256:16-64", 60, 4.0, sim.seed, 4096))
    s = res.summary
    assert s["role_flips"] == 0 and s["drain_batches"] == 0 and s["completed"] == 60


def test_drain_over_a_run_of_scheduled_flips_conserves_blocks_and_finishes_everything():
    # decode-heavy periods, then prompts: the oracle flips decode instances holding answers back to prefill
    wl = "phases:3:1500-2000:4-16:16-64:200-300:2.5"
    sim = SimulateConfig(workload=wl, rate=12.0, num_requests=150, **SIM)
    cfg = ClusterConfig(
        instances=[InstanceGroup(role="prefill", count=2), InstanceGroup(role="decode", count=3)],
        migration=MigrationSection(
            role_flip=True, moves=False, drain_residents=True, flip_oracle=PhaseOracle.phases(3, (3, 1))
        ),
    )
    res = run_cluster(sim, cfg, build_requests(wl, 150, 12.0, sim.seed, 4096), check_invariants=True)
    s = res.summary
    assert s["completed"] == 150 and s["unfinished"] == 0
    assert any(f["from"] == "decode" and f["running"] > 0 for f in s["role_log"])
    assert s["drain_moved"] > 0 and s["drain_batches"] >= 2
    assert all(_whole(m) for m in res.cluster.members)


def test_phase_oracle_schedule_and_its_run():
    o = PhaseOracle.phases(15, (6, 2), shift_s=(2.0, -3.0))
    assert o.schedule == ((2.0, 6), (12.0, 2))
    assert [o.wanted(t) for t in (1, 2, 11.9, 12, 31, 32, 42)] == [2, 6, 6, 2, 2, 6, 2]
    assert PhaseOracle.phases(15, (6, 2)).wanted(14.9) == 6
    early = PhaseOracle.phases(15, (6, 2), shift_s=(-1.0, 0.0))  # the cycle wraps: phase 0 from 29 s
    assert [early.wanted(t) for t in (0.5, 15, 28.9, 29)] == [6, 2, 2, 6]
    with pytest.raises(ValueError, match="count"):
        PhaseOracle.phases(15, (0, 2))
    with pytest.raises(ValueError, match="schedule"):
        PhaseOracle(cycle_s=30, schedule=((20.0, 2), (10.0, 6)))
    wl = "phases:3:1500-2000:4-16:16-64:200-300:2.5"
    sim = SimulateConfig(workload=wl, rate=10.0, num_requests=80, **SIM)
    cfg = ClusterConfig(
        instances=[InstanceGroup(role="prefill", count=2), InstanceGroup(role="decode", count=2)],
        migration=MigrationSection(role_flip=True, moves=False, flip_oracle=PhaseOracle.phases(3, (3, 1))),
    )
    res = run_cluster(sim, cfg, build_requests(wl, 80, 10.0, sim.seed, 4096), check_invariants=True)
    tr = res.summary["controller_trace"]
    assert res.summary["completed"] == 80
    # one flip per 0.5 s tick toward the schedule: by a second into each phase the count is the phase's
    for t, n in zip(tr["t_s"], tr["num_prefill"]):
        if n is not None and t % 3 >= 1.0 and t < 9:
            assert n == (3 if int(t // 3) % 2 == 0 else 1), (t, n)
    # flips_per_tick: the whole change at the tick where the phase begins
    fast = cfg.migration.model_copy(update={"flip_oracle": PhaseOracle.phases(3, (3, 1), flips_per_tick=4)})
    res = run_cluster(
        sim, cfg.model_copy(update={"migration": fast}), build_requests(wl, 80, 10.0, sim.seed, 4096)
    )
    log = res.summary["role_log"]
    assert [(f["t_s"], f["to"]) for f in log if 2.9 < f["t_s"] < 3.6] == [(3.0, "decode"), (3.0, "decode")]


def test_a_resident_aborted_while_its_kv_is_copied_or_in_the_stop_and_copy_frees_everything_once():
    """A client abort during the pre-copy (the request is still on the source) and during the stop-and-copy
    (it waits for its KV on the destination): the request ends aborted, the batch moves the others, and every
    block comes back (both holds go when the copy lands)."""
    sim = SimulateConfig(workload=DECODE_HEAVY, rate=30.0, num_requests=60, **SIM)
    cluster = build_cluster(sim, _cfg(**HELD), check_invariants=True)
    d0 = next(m for m in cluster.members if m.role == "decode")
    drain = cluster.migration.drain
    aborted = {}
    stop = drain._stop

    def stop_then_abort(b):  # abort one resident right after the stop: it waits for its KV on the destination
        stop(b)
        if b.reqs:
            r = next(iter(b.reqs.values()))
            assert r.state is RequestState.WAITING_FOR_KV
            aborted["final"] = r
            cluster.abort(r)

    drain._stop = stop_then_abort

    def flip():
        res = drain.residents(d0)
        cluster.set_role(d0, "prefill", "test")
        drain.drain(d0)
        aborted["precopy"] = res[-1]
        cluster.abort(res[-1])  # still decoding on the source while its blocks copy

    cluster.loop.at(1.5, flip)
    run = cluster.run(build_requests(DECODE_HEAVY, 60, 30.0, sim.seed, 4096))
    assert aborted["precopy"].state is RequestState.ABORTED and aborted["final"].state is RequestState.ABORTED
    (b,) = drain.log
    assert b.dropped == {"aborted": 2} and b.moved > 0
    assert sum(r.state is RequestState.FINISHED for r in run.requests) == 58
    assert all(_whole(m) for m in cluster.members)
