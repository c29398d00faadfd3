"""Prefix-cache poisoning (issue 22): a prompt planted under another prompt's block hash must not answer it.

A client who knows two token blocks with equal hashes sends one first; its KV is cached under the hash the
other (a popular system prompt, say) will look up. With SHA-256 names the two never share a hash; with any
hash, a hit whose cached tokens differ from the request's is a miss (counted). The poly64 pairs come from
``tests/test_hashing.py`` (poly64 is what named blocks before: it shows the token check working alone).
"""

from __future__ import annotations

import pytest
from conftest import make_request
from test_hashing import ISSUE_D, OWN_D

from kvbalance.kvcache.blocks import BlockPool
from kvbalance.kvcache.hashing import BlockHasher
from kvbalance.kvcache.manager import NO_HIT, KVCacheManager
from kvbalance.kvcache.prefix import RadixCache

BS = 16
VICTIM = [100] * BS + list(range(30, 62)) + [7, 8, 9]  # a 16-token block, two more full blocks, a tail
PLANTED = [100 + d for d in ISSUE_D] + VICTIM[
    BS:
]  # the first block differs; under poly64 every hash is equal


def _serve_and_finish(kv: KVCacheManager, req) -> None:
    """Admit ``req`` as the scheduler does, compute its whole prompt, publish its blocks, release it."""
    hit = kv.get_computed_blocks(req)
    kv.admit(req, hit, req.num_prompt_tokens)
    req.num_computed_tokens = req.num_prompt_tokens
    kv.cache_full_blocks(req)
    kv.check_invariants([req])
    kv.free(req)
    kv.forget(req)


def test_planted_hash_hit_with_other_tokens_is_a_miss_and_is_counted():
    kv = KVCacheManager(BlockPool(32, BS), hasher=BlockHasher("poly64"))
    _serve_and_finish(kv, make_request("attacker", PLANTED))
    victim = make_request("victim", VICTIM)
    assert kv.block_hashes(victim, 48) == kv.hasher.prefix_block_hashes(PLANTED, BS)  # the hashes do collide
    assert kv.cache.match_prefix(kv.block_hashes(victim, 50))[1] == 3  # a hash-only cache would serve it
    assert kv.get_computed_blocks(victim) is NO_HIT
    assert kv.cache.num_token_mismatches == 1
    kv.check_invariants([])


def test_mismatch_in_a_later_block_keeps_the_verified_prefix_and_splits_there():
    kv = KVCacheManager(BlockPool(32, BS), hasher=BlockHasher("poly64"))
    shared = list(range(200, 200 + BS))
    _serve_and_finish(kv, make_request("attacker", shared + PLANTED))
    victim = make_request("victim", shared + VICTIM)
    hit = kv.get_computed_blocks(victim)
    assert hit.num_blocks == 1 and kv.cache.num_token_mismatches == 1
    first = kv.cache.blocks_of(hit.node)
    assert len(first) == 1 and hit.node.tokens == bytearray(b"".join(t.to_bytes(8, "little") for t in shared))
    kv.check_invariants([])
    # the victim computes its own blocks from there (its admission looks up again: a second refusal); its
    # blocks cannot replace the planted ones under the same hashes, so the next victim is refused too
    _serve_and_finish(kv, victim)
    assert kv.cache.num_token_mismatches == 2
    again = kv.get_computed_blocks(make_request("v2", shared + VICTIM))
    assert again.num_blocks == 1 and kv.cache.num_token_mismatches == 3


def test_default_sha256_never_matches_the_planted_block():
    kv = KVCacheManager(BlockPool(32, BS))
    assert kv.hasher.algo == "sha256"
    _serve_and_finish(kv, make_request("attacker", PLANTED))
    assert kv.get_computed_blocks(make_request("victim", VICTIM)) is NO_HIT
    assert kv.cache.num_token_mismatches == 0  # refused by the hash, before the token check
    same = kv.get_computed_blocks(make_request("again", PLANTED))
    assert same.num_blocks == 3 and kv.cache.num_token_mismatches == 0


def test_cached_tokens_follow_their_blocks_through_split_growth_and_eviction():
    pool = BlockPool(16, 2)
    cache = RadixCache(pool)
    h = BlockHasher()
    toks = list(range(10))

    def tb(ts):
        return b"".join(t.to_bytes(8, "little", signed=True) for t in ts)

    hashes = h.prefix_block_hashes(toks, 2)
    table = pool.allocate(5)
    node, _ = cache.extend(cache.root, 0, hashes[:2], table, tb(toks[:4]))
    node, _ = cache.extend(node, 2, hashes, table, tb(toks[4:10]))  # grows the leaf in place
    assert node.tokens == bytearray(tb(toks))
    cache.unlock(node)
    pool.free(table)
    upper, n = cache.match_prefix(hashes[:3])  # splits after block 3
    assert n == 3 and upper.tokens == bytearray(tb(toks[:6])) and node.tokens == bytearray(tb(toks[6:]))
    assert cache.verify_tokens(upper, 3, tb(toks[:6])) == (upper, 3)
    assert cache.evict(1) == 1 and node.tokens == bytearray(tb(toks[6:8]))  # the tail trimmed with its tokens
    cache.check_invariants()
    wrong = tb(toks[:4] + [99, 5])
    verified, k = cache.verify_tokens(upper, 3, wrong)
    assert k == 2 and cache.blocks_of(verified) == table[:2] and cache.num_token_mismatches == 1
    with pytest.raises(ValueError, match="tokens: need"):
        cache.extend(cache.root, 0, h.prefix_block_hashes([50, 51], 2), pool.allocate(1), tb([50]))


def _answer(url: str, prompt: list[int]) -> tuple[list[int], list]:
    import httpx

    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["top_logprobs"]


def _planted_then_victim(**engine_kwargs) -> tuple[tuple, dict]:
    """Client A's planted prompt then client B's victim prompt on a live server (the server and torch extras:
    the light core skips these tests)."""
    for module in ("torch", "httpx", "fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(module)
    import httpx
    from server_support import live_server, make_engine, metric_values

    engine = make_engine(block_size=BS, **engine_kwargs)
    with live_server(engine) as url:
        _answer(url, PLANTED)  # client A plants its KV
        victim = _answer(url, VICTIM)  # client B
        with httpx.Client(base_url=url) as c:
            metrics = metric_values(c)
    return victim, metrics


@pytest.fixture(scope="module")
def own_answer():
    """Client B's answer from a server with prefix caching off (nothing can be planted)."""
    return _planted_then_victim(enable_prefix_caching=False)[0]


@pytest.mark.parametrize("algo", ["sha256", "blake2b", "poly64"])
def test_planted_prompt_gets_the_victim_its_own_answer_through_the_server(algo, own_answer):
    victim, metrics = _planted_then_victim(prefix_caching_hash_algo=algo, prefix_caching_salt="deploy-1")
    assert victim == own_answer  # greedy tokens and top-2 logprobs of every step
    assert metrics["kvbalance_prefix_hit_tokens_total"] == 0
    expected = 1 if algo == "poly64" else 0  # poly64's collision reaches the token check, which refuses it
    assert metrics["kvbalance_prefix_cache_token_mismatches_total"] == expected


def test_without_the_token_check_the_planted_kv_changes_the_answer(own_answer, monkeypatch):
    """The comparison above can see poisoning: unchecked poly64 serves B from A's KV and B's logprobs move."""
    monkeypatch.setattr(RadixCache, "verify_tokens", lambda self, node, n, tokens: (node, n))
    victim, metrics = _planted_then_victim(prefix_caching_hash_algo="poly64")
    assert metrics["kvbalance_prefix_hit_tokens_total"] == 48
    assert victim != own_answer


SYSTEM = (
    "You are a helpful assistant for the city library. Answer questions about opening hours, membership and "
    "events politely and briefly. The library opens at nine in the morning and closes at six in the evening, "
    "every day except Sunday, when it is closed. Membership is free for residents and costs twenty euros a "
    "year for visitors. Children under twelve need a parent to sign up. Events: a reading club on Tuesdays "
    "at five, a chess afternoon on Saturdays at two, and a film night on the first Friday of each month."
)


@pytest.mark.slow
def test_smollm2_system_prompt_poisoning_is_refused():
    """SmolLM2 at its CPU block size (64): the attacker shifts tokens 32-47 of a real system prompt by the
    poly64 collision found here; unchecked, the victim is answered from the planted KV (another answer)."""
    from kvbalance.llm import LLMEngine
    from kvbalance.request import SamplingParams

    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "When does it close on Mondays?"},
    ]
    sp = SamplingParams(max_tokens=12, temperature=0.0)

    def victim_answer(checked: bool, **kwargs) -> tuple[list[int], str]:
        engine = LLMEngine("smollm2-135m", kv_cache_tokens=4096, num_threads=1, dtype="float32", **kwargs)
        if not checked:
            engine.instance.cache.verify_tokens = lambda node, n, tokens: (node, n)
        victim = engine.chat_prompt(messages)
        planted = list(victim)
        for i, d in enumerate(OWN_D):
            planted[32 + i] += d
        assert engine.executor.block_size == 64 and len(victim) > 128
        for prompt in (planted, victim):
            req = engine.add_request(prompt, sp)
            engine.run_until_done()
        return list(req.output_token_ids), engine.tokenizer.decode(req.output_token_ids)

    answers = {
        "prefix caching off": victim_answer(True, enable_prefix_caching=False),
        "sha256 (default)": victim_answer(True),
        "poly64 + token check": victim_answer(True, prefix_caching_hash_algo="poly64"),
        "poly64 unchecked (the old cache)": victim_answer(False, prefix_caching_hash_algo="poly64"),
    }
    for what, (_, text) in answers.items():  # shown with -s
        print(f"{what}: {text!r}")
    own = answers["prefix caching off"][0]
    assert answers["sha256 (default)"][0] == own and answers["poly64 + token check"][0] == own
    assert answers["poly64 unchecked (the old cache)"][0] != own


@pytest.mark.parametrize("algo", ["sha256", "poly64"])
def test_the_global_kv_store_names_blocks_with_the_instances_hash(algo):
    """The store and the instances' caches key on one setting: SHA-256 by default (what a real store holds)."""
    from kvbalance.cluster.core import Cluster, sim_member
    from kvbalance.cluster.topology import Topology
    from kvbalance.kvcache.store import GlobalKVStore, StoreConfig
    from kvbalance.request import Request, SamplingParams
    from kvbalance.sim.config import SimulateConfig
    from kvbalance.specs import get_model

    cfg = SimulateConfig(model="llama-2-7b", gpu="a100-80gb", kv_tokens=20_000, prefix_caching_hash_algo=algo)
    members = [sim_member(i, "colocated", (i,), cfg) for i in range(2)]
    assert all(m.instance.kv.hasher.algo == algo for m in members)
    store = GlobalKVStore(StoreConfig(), bytes_per_block=BS * get_model("llama-2-7b").kv_bytes_per_token)
    prompt = list(range(1, 20 * BS + 1)) + [5, 6, 7]
    reqs = [
        Request(f"r{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True), arrival_s=i) for i in range(2)
    ]
    cluster = Cluster(members, Topology.build("a100-80gb", 2), router="round_robin", store=store)
    cluster.run(reqs)
    assert (
        cluster.store.fetched_blocks == 20
    )  # the second instance fetched the first's prefix, by these names:
    assert set(store._lru) == set(BlockHasher(algo).prefix_block_hashes(prompt, BS))
    assert (max(store._lru) >= 1 << 64) == (algo == "sha256")


def test_mooncake_hit_rates_do_not_depend_on_the_hash():
    """Same prefixes, other names: the simulator on the Mooncake trace gives the same run under every hash."""
    from kvbalance.sim.config import SimulateConfig
    from kvbalance.sim.run import run_simulation
    from kvbalance.workloads.presets import default_traces_dir

    path = default_traces_dir() / "mooncake_conversation_trace.jsonl"
    if not path.is_file():
        pytest.skip(f"Mooncake trace not found at {path}")
    runs = {}
    for algo in ("poly64", "sha256", "blake2b"):
        cfg = SimulateConfig(model="llama-2-7b", gpu="a100-80gb", workload=f"mooncake:{path}", num_requests=300,
                             rate=float("inf"), prefix_caching_hash_algo=algo)  # fmt: skip
        result = run_simulation(cfg)
        assert result.instance.cache.num_token_mismatches == 0
        runs[algo] = {k: result.summary[k] for k in ("prefix_hit_rate", "makespan_s")}
    assert runs["poly64"]["prefix_hit_rate"] > 0.2
    assert runs["sha256"] == runs["poly64"] == runs["blake2b"]
