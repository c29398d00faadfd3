"""Data-parallel Batch runs: the plan's ranks cover every request once, merged replica streams lose nothing,
and N Ray actors write the same outputs as one replica (Ray itself only in the slow test)."""

from __future__ import annotations

import json
import random
import time
import warnings

import pytest

pytest.importorskip("torch")

from kvbalance.llm import LLMEngine  # noqa: E402
from kvbalance.offline.batch_worker import EngineSpec, LocalBackend  # noqa: E402
from kvbalance.offline.ray_runner import merge_streams  # noqa: E402
from kvbalance.offline.runner import _contiguous_ranks, run_batch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")

SPEC = EngineSpec("tiny-llama", kv_cache_tokens=4096, max_num_batched_tokens=64, num_threads=1)


def write_job(path, n: int = 14) -> None:
    """Token-id prompts (no tokenizer needed, so Ray actors build the engine from SPEC alone)."""
    rng = random.Random(11)
    shared = [rng.randrange(256) for _ in range(30)]
    lines = []
    for i in range(n):
        ids = (shared if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randint(3, 50))]
        body = {"prompt": ids, "max_tokens": rng.randint(2, 8), "temperature": 0}
        lines.append(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
        )
    lines.insert(5, "not json")
    path.write_text("\n".join(lines) + "\n")


def comparable(path) -> list[dict]:
    out = []
    for line in open(path).read().splitlines():
        rec = json.loads(line)
        ((rec.get("response") or {}).get("body") or {}).pop("created", None)
        out.append(rec)
    return out


def engine() -> LLMEngine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SPEC.build()


def test_ranks_split_covers_every_request_once_and_balances_work():
    class P:  # stands in for PreparedRequest: only sizes matter
        def __init__(self, p, o):
            self.prompt_token_ids = [0] * p
            self.sampling = type("S", (), {"max_tokens": o})()

    rng = random.Random(0)
    todo = [P(rng.randint(1, 100), rng.randint(1, 50)) for _ in range(60)]
    ranks = _contiguous_ranks(todo, 4)
    assert [p for r in ranks for p in r] == todo  # contiguous runs, in order, each request once
    work = [sum(len(p.prompt_token_ids) + p.sampling.max_tokens for p in r) for r in ranks]
    assert max(work) - min(work) <= 2 * 150  # within two requests' worth of work


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_run_in_process_equals_one_replica(tmp_path, n):
    write_job(tmp_path / "in.jsonl")
    run_batch(tmp_path / "in.jsonl", tmp_path / "one.jsonl", LocalBackend(engine()), progress=False)
    s = run_batch(
        tmp_path / "in.jsonl", tmp_path / "dp.jsonl", LocalBackend(engine(), num_replicas=n), progress=False
    )
    assert s.num_generated == 14
    assert comparable(tmp_path / "dp.jsonl") == comparable(tmp_path / "one.jsonl")


def test_merge_streams_yields_every_item_and_raises_a_replica_failure():
    def stream(rank, k, fail=False):
        def run():
            for i in range(k):
                time.sleep(0.001 * ((rank + i) % 3))
                yield [(rank * 100 + i, {})]
            if fail:
                raise RuntimeError(f"replica {rank} died")

        return run

    got = sorted(i for batch in merge_streams([stream(r, 5) for r in range(3)]) for i, _ in batch)
    assert got == sorted(r * 100 + i for r in range(3) for i in range(5))
    seen = []
    with pytest.raises(RuntimeError, match="replica 1 died"):
        for batch in merge_streams([stream(0, 3), stream(1, 2, fail=True)]):
            seen.extend(i for i, _ in batch)
    assert {100, 101} <= set(seen)


@pytest.mark.slow
def test_ray_data_parallel_run_equals_single_replica(tmp_path):
    ray = pytest.importorskip("ray")
    from kvbalance.offline.ray_runner import RayBackend

    write_job(tmp_path / "in.jsonl")
    run_batch(tmp_path / "in.jsonl", tmp_path / "one.jsonl", LocalBackend(engine()), progress=False)
    try:
        backend = RayBackend(SPEC, 2, num_cpus=2)
        s = run_batch(tmp_path / "in.jsonl", tmp_path / "dp.jsonl", backend, progress=False)
        assert not ray.is_initialized()  # the backend that started Ray shut it down
    finally:
        ray.shutdown()
    assert (s.num_generated, s.num_line_errors) == (14, 1)
    assert comparable(tmp_path / "dp.jsonl") == comparable(tmp_path / "one.jsonl")
