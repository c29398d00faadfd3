"""The global KV store on real tensors: one prefill instance's prompt blocks, saved to the store's host copy,
are fetched by another instance for a longer prompt, and greedy tokens equal a single instance's that
computed everything, token for token — also when the store evicted part of the prefix in between.

The real path loads whole blocks when the fetch lands (before the request's next step), not layer by
layer: equality is what is checked here, the layer-wise timing is the simulator's (tests/test_cluster_store.py).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

torch = pytest.importorskip("torch")

from kvbalance.batch import BatchPlan, KVTransfer, ScheduledSeq  # noqa: E402
from kvbalance.cluster.connector import ClusterConnector, prompt_hashes  # noqa: E402
from kvbalance.cluster.core import Cluster, Member  # noqa: E402
from kvbalance.cluster.routers.base import Router  # noqa: E402
from kvbalance.cluster.topology import Topology  # noqa: E402
from kvbalance.engine import InstanceConfig, build_instance  # noqa: E402
from kvbalance.executor.store_worker import StoreWorker  # noqa: E402
from kvbalance.executor.torch import TorchExecutor  # noqa: E402
from kvbalance.kvcache.store import GlobalKVStore, StoreConfig  # noqa: E402
from kvbalance.model.llama import LlamaConfig  # noqa: E402
from kvbalance.model.weights import random_weights  # noqa: E402
from kvbalance.request import Request, RequestState, SamplingParams  # noqa: E402
from kvbalance.specs import get_model  # noqa: E402

BS = 4
NUM_BLOCKS = 64
P_LEN, S_LEN, F_LEN = 22, 7, 24  # P: 5 full blocks + 2 tokens; P + S: 29 tokens; the filler: 6 full blocks


class ByRequest(Router):
    """Sends each request to the instance the test names for it."""

    def __init__(self, where: dict[str, int]) -> None:
        super().__init__(BS)
        self.where = where

    def choose(self, req, loads) -> int:
        return self.where[req.request_id]


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _member(i: int, config, weights, role: str = "colocated") -> Member:
    ex = TorchExecutor(config, weights, num_blocks=NUM_BLOCKS, block_size=BS, num_threads=1)
    icfg = InstanceConfig(kv_tokens=NUM_BLOCKS * BS, block_size=BS, chunk_size=16, name=f"{role}-{i}")
    return Member(i, role, (i,), build_instance(icfg, ex, ClusterConnector(None, role)))


def _request(rid: str, prompt: list[int], arrival_s: float = 0.0) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=8, ignore_eos=True), arrival_s=arrival_s)


def _prompts(vocab: int) -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(11)
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    return draw(P_LEN), draw(S_LEN), draw(F_LEN)


def _record(cluster: Cluster) -> tuple[dict, dict]:
    """Per request: the chunks (start, tokens) its instance computed, and the logits of each sampled token."""
    computed: dict[str, list[tuple[int, int]]] = {}
    logits: dict[str, list] = {}
    for m in cluster.members:
        ex = m.instance.executor
        execute = ex.execute

        def recording(plan, ex=ex, execute=execute):
            for s in plan.seqs:
                computed.setdefault(s.request.request_id, []).append((s.start, s.num_new_tokens))
            result = execute(plan)
            for i, rid in enumerate(ex.last_logits_request_ids):
                logits.setdefault(rid, []).append(ex.last_logits[i].clone())
            return result

        ex.execute = recording
    return computed, logits


def _single(config, weights, prompt: list[int]) -> tuple[list[int], list]:
    """Greedy tokens (and their logits) of one instance that computes the whole prompt: no store, no cache."""
    cluster = Cluster([_member(0, config, weights)], Topology.build("a100-80gb", 1), router="round_robin")
    _, logits = _record(cluster)
    run = cluster.run([_request("ref", prompt)])
    assert run.requests[0].state is RequestState.FINISHED
    return run.requests[0].output_token_ids, logits["ref"]


def _same_as_single(config, weights, req: Request, logits: dict) -> None:
    """Token for token a single instance's output; logits equal to float32 rounding (chunks differ)."""
    tokens, ref_logits = _single(config, weights, req.prompt_token_ids)
    assert req.output_token_ids == tokens
    got = logits[req.request_id]
    assert len(got) == len(ref_logits) == len(tokens)
    for a, b in zip(got, ref_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def _spy(cluster: Cluster) -> tuple[dict, dict, list]:
    """``_record``, and check that every store copy is bit-exact."""
    computed, logits = _record(cluster)
    worker = cluster.store.worker
    save, load, loads = worker.save, worker.load, []

    def checked_save(ex, t):
        save(ex, t)
        for b, h in zip(t.block_ids, t.block_hashes):
            assert torch.equal(worker.blocks[h], ex.read_blocks([b])[:, :, 0])

    def checked_load(ex, t):
        load(ex, t)
        got = ex.read_blocks(t.block_ids)
        assert got.abs().sum() > 0
        for i, h in enumerate(t.block_hashes):
            assert torch.equal(got[:, :, i], worker.blocks[h])
        loads.append((t, list(t.block_ids), set(worker.blocks)))

    worker.save, worker.load = checked_save, checked_load
    return computed, logits, loads


def _check_conserved(cluster: Cluster, store: GlobalKVStore) -> None:
    """Nothing leaked: no block held in either pool, nothing pinned, the host copy is exactly the store."""
    for m in cluster.members:
        inst = m.instance
        inst.check_invariants()
        assert inst.kv_used_tokens == 0 and not inst.has_work()
        assert inst.pool.num_free + inst.cache.evictable_blocks == inst.pool.num_blocks
    store.check_invariants()
    worker = cluster.store.worker
    assert len(worker) == len(store) and all(h in store and store.pinned(h) == 0 for h in worker.blocks)
    assert worker.nbytes == len(store) * store.bytes_per_block


def _store_hand_off(config, weights, capacity_blocks: int | None, roles=("colocated", "colocated")) -> None:
    """A serves P (saved to the store); [A serves a filler F]; B serves P + S and fetches what is left of P.

    ``roles``: A and B are colocated, or the prefill instances of a P/D cluster (then a decode instance
    follows): a prefill request finishes in the step that ends its prompt, and its blocks still reach the
    store."""
    P, S, F = _prompts(config.vocab_size)
    members = [_member(i, config, weights, role) for i, role in enumerate(roles)]
    bpb = members[0].instance.executor.kv_bytes_per_block
    cap = StoreConfig() if capacity_blocks is None else StoreConfig(capacity_bytes=capacity_blocks * bpb)
    store = GlobalKVStore(cap, bpb)
    reqs = [_request("p", P, 0.0)]
    if capacity_blocks is not None:
        reqs.append(_request("f", F, 50.0))
    reqs.append(_request("ps", P + S, 100.0))  # long after the others finished (simulated seconds)
    where = {"p": 0, "f": 0, "ps": 1}
    cluster = Cluster(
        members,
        Topology.build("a100-80gb", len(roles)),
        router=ByRequest(where),
        store=store,
        check_invariants=True,
    )
    computed, logits, loads = _spy(cluster)
    run = cluster.run(reqs)
    assert all(r.state is RequestState.FINISHED for r in run.requests)
    by_id = {r.request_id: r for r in run.requests}

    p_hashes = prompt_hashes(by_id["p"], BS, P_LEN)
    assert len(p_hashes) == P_LEN // BS == 5
    # what is left of P in the store when B looks: all of it, or — capacity 10, high watermark int(9.5) = 9,
    # low int(9.0) = 9 — the filler's 6 blocks push out P's two least recent (deepest) blocks: P saved its
    # blocks children first, so its first 3 blocks are the more recently used ones
    left = 5 if capacity_blocks is None else 3
    assert [f.req.request_id for f in cluster.store.fetches] == ["ps"]
    fetch = cluster.store.fetches[0]
    assert fetch.hashes == p_hashes[:left]
    ((transfer, table, held_at_load),) = loads  # one load, run when the fetch landed, into B's first blocks
    assert transfer is fetch.transfer and transfer.direction == "load" and transfer.peer == "store"
    assert transfer.block_hashes == p_hashes[:left] and transfer.num_tokens == left * BS
    assert table == transfer.block_ids and len(table) == left
    if (
        capacity_blocks is not None
    ):  # the evicted blocks had left the host copy too (B saves them again later)
        assert store.num_evicted > 0 and not held_at_load & set(p_hashes[left:])
    # B computed only what the store did not give: the prompt past the fetched blocks, then its decodes
    prompt_chunks = [(s, n) for s, n in computed["ps"] if s < P_LEN + S_LEN]
    assert prompt_chunks[0][0] == left * BS
    assert sum(n for _, n in prompt_chunks) == P_LEN + S_LEN - left * BS
    assert sum(n for s, n in computed["p"] if s < P_LEN) == P_LEN  # A computed all of P
    assert members[1].instance.load().external_hit_tokens == left * BS
    for r in run.requests:  # token for token what a single instance computing everything gives
        _same_as_single(config, weights, r, logits)
    _check_conserved(cluster, store)


def _tiny():
    # untied LM head: with tied embeddings a random model's greedy token mostly repeats the last input token,
    # whatever the prefix's KV holds; untied, later tokens depend on the prefix (and logits are compared too)
    config = dataclasses.replace(LlamaConfig.from_spec(get_model("tiny-llama")), tie_word_embeddings=False)
    return config, random_weights(config, seed=3)


def test_store_hands_a_prefix_to_another_instance_on_real_tensors():
    _store_hand_off(*_tiny(), capacity_blocks=None)


def test_store_eviction_leaves_a_shorter_prefix_and_the_rest_is_recomputed():
    _store_hand_off(*_tiny(), capacity_blocks=10)


def test_store_hand_off_between_the_prefill_instances_of_a_pd_cluster():
    _store_hand_off(*_tiny(), capacity_blocks=10, roles=("prefill", "prefill", "decode"))


def test_store_rejects_a_block_size_that_is_not_the_executors():
    config, weights = _tiny()
    members = [_member(i, config, weights) for i in range(2)]
    store = GlobalKVStore(StoreConfig(), members[0].instance.executor.kv_bytes_per_block + 1)
    with pytest.raises(ValueError, match="bytes_per_block"):
        Cluster(members, Topology.build("a100-80gb", 2), store=store)


def test_store_worker_as_transfer_handler_saves_after_the_forward_and_loads_before_it():
    """Store transfers riding in a plan: a save names blocks the same step writes, a load feeds the step."""
    config, weights = _tiny()
    worker = StoreWorker()
    a, b, ref = (
        TorchExecutor(config, weights, num_blocks=8, block_size=BS, num_threads=1, transfer_handler=worker)
        for _ in range(3)
    )
    prompt = random.Random(2).sample(range(3, config.vocab_size), 9)
    hashes = [11, 22]  # the store's names for the prompt's two full blocks
    r = Request("r", prompt[:8], SamplingParams(max_tokens=1))
    r.block_ids = [3, 5]
    save = KVTransfer("r", [3, 5], 8, "save", "store", hashes)
    res = a.execute(BatchPlan([ScheduledSeq(r, 0, 8, True)], BS, kv_saves=[save]))
    assert res.finished_saves == ["r"] and set(worker.blocks) == set(hashes)
    for blk, h in zip([3, 5], hashes):  # the step's KV, not the zeros the blocks held before it
        assert worker.blocks[h].abs().sum() > 0 and torch.equal(
            worker.blocks[h], a.read_blocks([blk])[:, :, 0]
        )
    r2 = Request("r2", prompt, SamplingParams(max_tokens=1))
    r2.block_ids = [7, 1, 2]
    load = KVTransfer("r2", [7, 1], 8, "load", "store", hashes)
    res = b.execute(BatchPlan([ScheduledSeq(r2, 8, 1, True)], BS, kv_loads=[load]))
    assert res.finished_loads == ["r2"] and worker.loaded_blocks == 2
    r3 = Request("r3", prompt, SamplingParams(max_tokens=1))
    r3.block_ids = [0, 1, 2]
    want = ref.execute(BatchPlan([ScheduledSeq(r3, 0, 9, True)], BS))
    assert res.sampled["r2"] == want.sampled["r3"]
    torch.testing.assert_close(b.last_logits, ref.last_logits, rtol=0, atol=1e-4)
    assert worker.retain(lambda h: h == 11) == 1 and list(worker.blocks) == [11]


def test_store_worker_names_the_field_of_a_bad_transfer():
    config, weights = _tiny()
    ex = TorchExecutor(config, weights, num_blocks=4, block_size=BS, num_threads=1)
    worker = StoreWorker()
    with pytest.raises(ValueError, match="peer"):
        worker(ex, KVTransfer("x", [0], 4, "save", "peer-1", [1]))
    with pytest.raises(ValueError, match="block_hashes"):
        worker(ex, KVTransfer("x", [0, 1], 8, "save", "store", [1]))
    with pytest.raises(ValueError, match="direction"):
        worker(ex, KVTransfer("x", [0], 4, "sideways", "store", [1]))
    with pytest.raises(KeyError, match="block_hashes"):
        worker(ex, KVTransfer("x", [0], 4, "load", "store", [1]))


@pytest.mark.slow
@pytest.mark.parametrize(
    "capacity_blocks, roles",
    [
        (None, ("colocated", "colocated")),
        (10, ("colocated", "colocated")),
        (10, ("prefill", "prefill", "decode")),
    ],
    ids=["whole-prefix", "evicted-tail", "pd-evicted-tail"],
)
def test_store_with_smollm2_gives_the_single_instance_tokens(capacity_blocks, roles):
    from kvbalance.model.weights import load_smollm2

    loaded = load_smollm2(with_tokenizer=False)
    _store_hand_off(loaded.config, loaded.state_dict, capacity_blocks, roles)
