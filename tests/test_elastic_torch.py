"""The elastic reserve on real tensors: the KV tensor has base + E blocks, the region [base, base + E)
joins and leaves the free list, and greedy outputs are identical with and without lending — through
forced lend/reclaim cycles, including reclaims that preempt requests holding lent blocks."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from kvbalance.engine import Instance  # noqa: E402
from kvbalance.executor.torch import TorchExecutor  # noqa: E402
from kvbalance.kvcache.elastic import ElasticConfig  # noqa: E402
from kvbalance.model.llama import LlamaConfig  # noqa: E402
from kvbalance.model.weights import random_weights  # noqa: E402
from kvbalance.request import Request, RequestState, SamplingParams  # noqa: E402
from kvbalance.scheduler import SchedulerConfig  # noqa: E402
from kvbalance.specs import get_model  # noqa: E402

BS = 4
BASE = 16
RESERVE = 10


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    config = LlamaConfig.from_spec(get_model("tiny-llama"))
    yield config, random_weights(config, seed=3)
    torch.set_num_threads(threads)  # the executors below run single-threaded (tiny GEMMs)


def workload():
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(6, 12))] for _ in range(6)]
    reqs = [
        Request(f"t{i}", p, SamplingParams(max_tokens=26, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    # three at once; the rest arrive while the first ones decode in lent blocks
    return reqs[:3], {14: reqs[3], 30: reqs[4], 44: reqs[5]}


def run(instance: Instance, first, later, on_step=None):
    for r in first:
        assert instance.add_request(r, 0.0)
    now = 0.0
    for i in range(400):
        if i in later:
            assert instance.add_request(later[i], now)
        out = instance.step(now)
        if out is None:
            if i > max(later):
                break
            continue
        now += 0.01
        instance.complete(out, now)
        instance.check_invariants()
        if on_step:
            on_step(instance)
    return [*first, *later.values()]


def test_greedy_outputs_identical_with_and_without_lending(tiny):
    config, weights = tiny
    sched = SchedulerConfig(max_num_batched_tokens=32, watermark=0.0)

    ref_first, ref_later = workload()
    ref = Instance(
        TorchExecutor(config, weights, num_blocks=64, block_size=BS, num_threads=1),
        num_blocks=64,
        block_size=BS,
        scheduler_config=sched,
    )
    ref_reqs = run(ref, ref_first, ref_later)

    ex = TorchExecutor(config, weights, num_blocks=BASE + RESERVE, block_size=BS, num_threads=1)
    assert (
        ex.num_blocks == BASE + RESERVE and BASE + RESERVE in ex.kv_cache.shape
    )  # the region is real KV memory
    elastic = ElasticConfig(reserve_blocks=RESERVE, block_bytes=ex.kv_bytes_per_block)
    inst = Instance(ex, num_blocks=BASE, block_size=BS, scheduler_config=sched, elastic=elastic)
    used_lent = []

    def watch(instance):
        lent = {b for r in instance.scheduler.running for b in r.block_ids if b >= BASE}
        used_lent.append(len(lent))
        if instance.elastic.lent:
            assert instance.pool.num_blocks == BASE + RESERVE
        else:
            assert instance.pool.num_blocks == BASE

    first, later = workload()
    reqs = run(inst, first, later, watch)

    el = inst.elastic
    assert max(used_lent) > 0  # requests really computed KV in lent blocks
    assert el.num_lends >= 2 and el.num_reclaims >= 2
    assert el.drain_preemptions >= 1  # a reclaim preempted a request holding lent blocks
    assert all(r.state is RequestState.FINISHED for r in [*reqs, *ref_reqs])
    for mine, theirs in zip(reqs, ref_reqs):
        assert mine.output_token_ids == theirs.output_token_ids, mine.request_id
    assert len({tuple(r.output_token_ids) for r in reqs}) == len(reqs)  # not trivially equal
