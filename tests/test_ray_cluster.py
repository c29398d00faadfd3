"""The real cluster on Ray: P/D through actors gives one instance's greedy tokens, a prefix fetched from the
store actor equals recomputing it, a live-migrated request's tokens equal an unmigrated run, and a killed
actor loses no other request and leaks no block. Tiny random models (untied LM head: a tied one mostly
repeats its last input token whatever the KV holds), float32, 2 actors per cluster, one Ray per module."""

from __future__ import annotations

import random
import shutil
import tempfile
import time
import warnings

import pytest

pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from kvbalance.llm import LLMEngine  # noqa: E402
from kvbalance.raycluster.backend import InstanceError  # noqa: E402
from kvbalance.raycluster.config import parse_cluster_file  # noqa: E402
from kvbalance.raycluster.launch import launch  # noqa: E402
from kvbalance.request import SamplingParams  # noqa: E402
from kvbalance.server.backend import RequestFailed  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")

MODEL = "tiny-llama-untied"
ENGINE = {
    "model": MODEL,
    "kv_tokens": 2048,
    "block_size": 4,
    "chunk_size": 32,
    "dtype": "float32",
    "threads": 1,
}
DRIVE_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def ray_session():
    temp = tempfile.mkdtemp(prefix="kvb-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def start(section: dict, **engine):
    eng, cfg = parse_cluster_file({**ENGINE, **engine, "cluster": section})
    return launch(eng, cfg)


def prompts(n: int, seed: int = 7, shared: int = 0, lengths=(5, 30)) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(3, 256) for _ in range(shared)]
    return [head + [rng.randrange(3, 256) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def reference(ps: list[list[int]], max_tokens: list[int], **engine) -> list[list[int]]:
    """Greedy tokens of one in-process instance with the same engine arguments."""
    kw = {**ENGINE, **engine}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = LLMEngine(
            kw["model"], kv_cache_tokens=kw["kv_tokens"], block_size=kw["block_size"],
            max_num_batched_tokens=kw["chunk_size"], dtype=kw["dtype"], num_threads=1,
        )  # fmt: skip
    reqs = [eng.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(ps, max_tokens)]
    eng.run_until_done()
    return [r.output_token_ids for r in reqs]


def drive(backend, until=None, timeout_s: float = DRIVE_TIMEOUT_S):
    """Step until nothing is left (or ``until(tokens)`` holds): tokens per request id, failures by id."""
    tokens: dict[str, list[int]] = {}
    failed: dict[str, BaseException] = {}
    deadline = time.monotonic() + timeout_s
    while backend.has_unfinished():
        assert time.monotonic() < deadline, (
            f"cluster did not finish in {timeout_s} s: {list(backend.tracked)}"
        )
        for out in backend.step():
            if isinstance(out, RequestFailed):
                failed[out.request_id] = out.error
            else:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if until is not None and until(tokens):
            break
    return tokens, failed


def submit(backend, ps, max_tokens, prefix="r"):
    ids = []
    for i, (p, m) in enumerate(zip(ps, max_tokens)):
        rid = f"{prefix}{i}"
        backend.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True), rid)
        ids.append(rid)
    return ids


def assert_no_leak(backend) -> None:
    for name, c in backend.check().items():  # check() runs each instance's block invariants too
        assert c["running"] == c["waiting"] == c["loading"] == c["held"] == c["loads_in_flight"] == 0, (
            name,
            c,
        )
        assert c["free_blocks"] + c["cached_blocks"] == c["num_blocks"], (name, c)
        assert c["requests"] == 0, (name, c)


@pytest.fixture(scope="module")
def pd_cluster(ray_session):
    c = start({"instances": [{"role": "prefill"}, {"role": "decode"}], "router": "round_robin"})
    yield c
    c.close()


@pytest.fixture(scope="module")
def store_cluster(ray_session):
    c = start(
        {
            "instances": [{"role": "colocated", "count": 2}],
            "router": "round_robin",
            "store": {"capacity_gb": 0.01},
        }
    )
    yield c
    c.close()


def test_pd_through_actors_gives_the_single_instance_tokens(pd_cluster):
    b = pd_cluster.backend
    ps, mt = prompts(6), [12, 1, 9, 12, 5, 12]
    before = b.counters["pd_transfers"]
    ids = submit(b, ps, mt, "pd")
    tokens, failed = drive(b)
    assert not failed
    assert [tokens[i] for i in ids] == reference(ps, mt)
    # every request that goes on past its first token was handed off through the object store
    assert b.counters["pd_transfers"] - before == sum(m > 1 for m in mt)
    stats = ray.get(b.slots[1].actor.stats.remote())
    assert stats["handoff_loads"] >= 5 and stats["bytes_loaded"] > 0
    assert_no_leak(b)


def test_pd_abort_while_decoding_frees_blocks_on_both_sides(pd_cluster):
    b = pd_cluster.backend
    ps = prompts(3, seed=11)
    ids = submit(b, ps, [40, 40, 40], "ab")
    drive(b, until=lambda t: len(t.get("ab1", [])) >= 3)  # ab1 is decoding on the decode actor
    for rid in ids:
        b.abort(rid)
    drive(b)
    assert_no_leak(b)


def test_prefix_fetched_from_the_store_equals_recomputing_it(store_cluster):
    b = store_cluster.backend
    ps = prompts(2, seed=3, shared=24)  # 24 shared tokens = 6 full blocks of 4
    first = submit(b, ps[:1], [6], "s")  # round robin: on colocated-0, its prompt's blocks go to the store
    drive(b)
    hits_before = b.slots[1].load.external_hit_tokens if b.slots[1].load else 0
    ids = submit(b, ps[1:], [10], "t")  # on colocated-1: a local miss, a store hit
    tokens, failed = drive(b)
    assert not failed
    assert tokens[ids[0]] == reference(ps[1:], [10])[0]
    assert b.slots[1].load.external_hit_tokens - hits_before >= 24
    stats = ray.get(b.store.stats.remote())
    assert stats["fetched_blocks"] >= 6 and stats["pinned_requests"] == 0
    ray.get(b.store.check.remote())
    assert first
    assert_no_leak(b)


def test_live_migrated_request_gives_the_unmigrated_tokens(store_cluster):
    b = store_cluster.backend
    ps = prompts(2, seed=5)
    ids = submit(b, ps, [30, 4], "m")  # m0 on colocated-0 (or -1: round robin goes on from earlier tests)
    home = b.tracked[ids[0]].home
    tokens, _ = drive(b, until=lambda t: len(t.get(ids[0], [])) >= 4)
    assert b.migrate(ids[0], 1 - home)
    more, failed = drive(b)
    assert not failed
    for rid, toks in more.items():
        tokens.setdefault(rid, []).extend(toks)
    assert [tokens[i] for i in ids] == reference(ps, [30, 4])
    (mv,) = [m for m in b.migrations.log if m.rid == ids[0]]
    assert mv.outcome == "committed" and not mv.recomputed and mv.stages >= 1 and mv.bytes_moved > 0
    assert mv.src == home and mv.dst == 1 - home
    assert_no_leak(b)


def test_killed_actor_loses_no_other_request_and_leaks_no_block(ray_session):
    c = start({"instances": [{"role": "colocated", "count": 2}], "router": "round_robin"}, max_num_seqs=1)
    try:
        b = c.backend
        ps, mt = prompts(6, seed=9), [30, 8, 8, 8, 8, 8]
        ids = submit(b, ps, mt, "k")  # k0, k2, k4 on colocated-0 (one at a time); k1, k3, k5 on colocated-1
        assert [b.tracked[i].home for i in ids] == [0, 1, 0, 1, 0, 1]
        tokens, failed = drive(b, until=lambda t: len(t.get("k0", [])) >= 2)
        ray.kill(b.slots[0].actor, no_restart=True)
        more, failed = drive(b)
        for rid, toks in more.items():
            tokens.setdefault(rid, []).extend(toks)
        assert set(failed) == {"k0"} and isinstance(failed["k0"], InstanceError)
        assert "colocated-0" in str(failed["k0"])
        ref = reference(ps, mt)
        for i in range(1, 6):  # k2 and k4 had streamed nothing: retried on colocated-1
            assert tokens[ids[i]] == ref[i], ids[i]
        assert b.counters["instance_failures"] == 1 and b.counters["retries"] == 2
        assert not b.slots[0].alive
        late = submit(b, prompts(1, seed=2), [5], "late")  # the router skips the dead instance
        assert b.tracked[late[0]].home == 1
        tokens, failed = drive(b)
        assert not failed and len(tokens[late[0]]) == 5
        assert_no_leak(b)  # the survivor only
    finally:
        c.close()


def test_64_concurrent_streams_through_the_front_end_on_loopback(pd_cluster):
    import asyncio
    import json
    import socket
    import threading

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from kvbalance.raycluster.launch import create_cluster_app
    from kvbalance.server.metrics import parse_prometheus_text
    from kvbalance.server.serving import make_server

    b = pd_cluster.backend
    routed_before = b.slots[0].routed
    app, aengine = create_cluster_app(pd_cluster, model_name=MODEL, max_queue=128)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = make_server(app, "127.0.0.1", port, drain_timeout_s=5.0, log_level="warning", lifespan="on")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    ps = prompts(64, seed=13)
    mt = [random.Random(i).randint(2, 10) for i in range(64)]

    async def one(client, i: int) -> tuple[list[int], str | None]:
        body = {
            "model": MODEL,
            "prompt": ps[i],
            "max_tokens": mt[i],
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        toks, finish = [], None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    toks += choice["token_ids"]
                    finish = choice["finish_reason"] or finish
        return toks, finish

    async def all_of_them():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    try:
        results = asyncio.run(asyncio.wait_for(all_of_them(), 150))
        assert [f for _, f in results] == ["length"] * 64
        assert [t for t, _ in results] == reference(ps, mt)
        m = parse_prometheus_text(httpx.get(url + "/metrics", timeout=10).text)
        assert (
            m['kvbalance_cluster_routed_requests_total{instance="prefill-0",role="prefill"}'] - routed_before
            == 64
        )
        assert m["kvbalance_cluster_pd_transfers_total"] >= 64
        assert m['kvbalance_cluster_instance_alive{instance="decode-0",role="decode"}'] == 1.0
        assert m['kvbalance_requests_total{finish_reason="length"}'] == 64
    finally:
        server.should_exit = True
        thread.join(30)
        aengine.shutdown()
    assert_no_leak(b)


@pytest.mark.slow
def test_killed_decode_actor_fails_only_its_requests_and_the_cluster_keeps_serving(ray_session):
    section = {"instances": [{"role": "prefill"}, {"role": "decode", "count": 2}], "router": "round_robin",
               "decode_router": "round_robin"}  # fmt: skip
    c = start(section)
    try:
        b = c.backend
        ps, mt = prompts(4, seed=21), [40, 40, 40, 40]
        ids = submit(b, ps, mt, "d")
        tokens, _ = drive(b, until=lambda t: all(len(t.get(i, [])) >= 3 for i in ids))
        on_dead = {i for i in ids if b.tracked[i].home == 1}
        assert on_dead and b.slots[1].name == "decode-0"
        ray.kill(b.slots[1].actor, no_restart=True)
        more, failed = drive(b)
        for rid, toks in more.items():
            tokens.setdefault(rid, []).extend(toks)
        assert set(failed) == on_dead and all("decode-0" in str(e) for e in failed.values())
        ref = reference(ps, mt)
        for k, rid in enumerate(ids):
            if rid not in on_dead:
                assert tokens[rid] == ref[k]
        late = submit(b, prompts(1, seed=4), [6], "late")
        tokens, failed = drive(b)
        assert not failed and len(tokens[late[0]]) == 6
        assert_no_leak(b)
    finally:
        c.close()


@pytest.mark.slow
def test_killed_prefill_actor_retries_what_it_had_not_streamed(ray_session):
    section = {"instances": [{"role": "prefill", "count": 2}, {"role": "decode"}], "router": "round_robin"}
    c = start(section, max_num_seqs=1)
    try:
        b = c.backend
        ps, mt = prompts(6, seed=17, lengths=(150, 250)), [6] * 6  # ~6 prefill steps each
        ids = submit(b, ps, mt, "p")  # p0, p2, p4 queue on prefill-0 one at a time
        tokens, _ = drive(b, until=lambda t: len(t.get("p0", [])) >= 2)  # p0's KV reached the decode actor
        silent = [
            rid for rid in ids if not tokens.get(rid)
        ]  # nothing streamed yet: must be retried, not failed
        ray.kill(b.slots[0].actor, no_restart=True)
        more, failed = drive(b)
        for rid, toks in more.items():
            tokens.setdefault(rid, []).extend(toks)
        ref = reference(ps, mt)
        for k, rid in enumerate(ids):  # each request finished right, or failed naming the dead instance
            if rid in failed:
                assert "prefill-0" in str(failed[rid]) and tokens.get(rid), (
                    rid
                )  # it had streamed its first token
            else:
                assert tokens[rid] == ref[k], rid
        assert "p0" not in failed and not failed.keys() & set(silent)
        assert b.counters["instance_failures"] == 1 and b.counters["retries"] >= 1
        assert not b.slots[0].alive
        late = submit(b, prompts(2, seed=3), [4, 4], "late")  # the router skips the dead instance
        assert {b.tracked[r].home for r in late} == {1}
        tokens, failed = drive(b)
        assert not failed and all(len(tokens[r]) == 4 for r in late)
        assert_no_leak(b)
    finally:
        c.close()


@pytest.mark.slow
def test_pd_with_smollm2_gives_the_single_instance_tokens(ray_session):
    engine = {"model": "smollm2-135m", "kv_tokens": 8192, "block_size": 16, "chunk_size": 256}
    c = start({"instances": [{"role": "prefill"}, {"role": "decode"}]}, **engine)
    try:
        b = c.backend
        ps, mt = prompts(4, seed=1, shared=40), [16, 16, 16, 16]
        ids = submit(b, ps, mt, "sm")
        tokens, failed = drive(b, timeout_s=300)
        assert not failed
        assert [tokens[i] for i in ids] == reference(ps, mt, **engine)
        assert_no_leak(b)
    finally:
        c.close()


def test_llumnix_pairing_moves_requests_between_actors_and_tokens_stay_the_same(store_cluster):
    from kvbalance.cluster.llumnix import LlumnixSection

    b = store_cluster.backend
    moved_before = len([m for m in b.migrations.log if m.outcome == "committed"])
    # every instance with a request counts as short of KV (threshold far above any freeness), an idle one as
    # free: the request moves to the idle instance, then back, every pairing round
    b.set_llumnix(LlumnixSection(pair_interval_s=0.05, migrate_out_threshold_blocks=1e9))
    try:
        ps = prompts(2, seed=31)
        ids = submit(b, ps, [48, 2], "ll")
        tokens, failed = drive(b)
    finally:
        b.set_llumnix(None)
    assert not failed
    assert [tokens[i] for i in ids] == reference(ps, [48, 2])
    moves = [m for m in b.migrations.log if m.outcome == "committed"]
    assert len(moves) - moved_before >= 1 and not b.migrations.active
    assert_no_leak(b)
