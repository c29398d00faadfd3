"""The real cluster's parts that need no Ray: the serve config's errors, the KV wire format, the store actor's
bookkeeping (run in-process: it is a plain class), and ``kvbalance serve --cluster``'s refusals."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbalance.kvcache.store import StoreConfig  # noqa: E402
from kvbalance.raycluster.config import parse_cluster_file  # noqa: E402
from kvbalance.raycluster.store import KVStoreActor  # noqa: E402
from kvbalance.raycluster.wire import from_wire, to_wire  # noqa: E402


def _err(data: dict) -> str:
    with pytest.raises(ValueError) as e:
        parse_cluster_file(data)
    return str(e.value)


def test_cluster_file_reuses_the_simulators_schema_and_adds_cores():
    eng, cfg = parse_cluster_file(
        {"model": "tiny-llama", "kv_tokens": 512,
         "cluster": {"instances": [{"role": "prefill", "cpu_cores": [0]}, {"role": "decode", "count": 2, "cpu_cores": ["1", "2-3"]}],
                     "router": "cache_aware", "store": {"capacity_gb": 1}}}
    )  # fmt: skip
    assert eng.model == "tiny-llama" and eng.engine_kwargs()["kv_cache_tokens"] == 512
    assert cfg.instance_plan() == [("prefill-0", "prefill", "0", 0.0), ("decode-0", "decode", "1", 0.0),
                                   ("decode-1", "decode", "2-3", 0.0)]  # fmt: skip
    assert cfg.store.to_store_config().capacity_bytes == 1e9 and cfg.describe() == "1xP + 2xD"


@pytest.mark.parametrize(
    "data, field",
    [
        ({"cluster": {"router": "nope"}}, "cluster.router"),
        ({"cluster": {"instances": [{"count": 2, "cpu_cores": ["0"]}]}}, "cluster.instances.0"),
        ({"cluster": {"instances": [{"tp": 2}]}}, "tp"),
        ({"cluster": {"instances": [{"role": "prefill"}]}}, "prefill instances need decode"),
        ({"cluster": {"migration": {}}}, "migration"),
        ({"cluster": {"layerwise_transfer": True}}, "layerwise_transfer"),
        ({"cluster": {"engine": "vllm-v1"}}, "engine: a simulated"),
        ({"cluster": {"instances": [{"role": "prefill"}, {"role": "decode"}]}, "dtype": "int4"}, "dtype"),
        ({"cluster": {}, "kv_token": 5}, "kv_token"),
        ({"router": "x"}, "cluster: the file has no cluster: section"),
    ],
)
def test_cluster_file_errors_name_the_field(data, field):
    assert field in _err(data)


def test_serve_cluster_refuses_a_global_cpu_cores_flag(tmp_path):
    from kvbalance.cli import main

    f = tmp_path / "c.yaml"
    f.write_text("cluster:\n  instances: [{role: colocated}]\n")
    assert main(["serve", "--cluster", str(f), "--cpu-cores", "0"]) != 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster:\n  router: nope\n")
    assert main(["serve", "--cluster", str(bad)]) != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_wire_round_trips_kv_blocks_bit_for_bit(dtype):
    blocks = torch.randn(2, 2, 3, 4, 2, 8).to(dtype)
    array, name = to_wire(blocks)
    assert isinstance(array, np.ndarray) and array.nbytes == blocks.numel() * blocks.element_size()
    array.setflags(write=False)  # as ray.get hands it out of the object store
    back = from_wire(array, name)
    assert back.dtype == dtype and torch.equal(back, blocks)


def _blocks(n: int, fill: float) -> np.ndarray:
    return np.full((2, 2, n, 4, 1, 2), fill, dtype=np.float32)


def test_store_actor_keeps_exactly_the_stored_blocks_and_pins_what_a_fetch_reads():
    bpb = _blocks(1, 0).nbytes
    s = KVStoreActor(StoreConfig(10 * bpb, high_watermark=0.8, eviction_ratio=0.3), bpb)
    assert s.put([1, 2, 3], np.concatenate([_blocks(1, 1), _blocks(1, 2), _blocks(1, 3)], axis=2)) == 3
    assert s.absent([1, 2, 9]) == [9]
    assert s.match_pin("p0", "r", [1, 2, 7]) == 2
    got = s.fetch("p0", "r", 1, 1)  # block 2 only: the request had block 1 locally
    assert got.shape == (2, 2, 1, 4, 1, 2) and (got == 2).all()
    s.check()
    assert s.stats()["pinned_requests"] == 0  # a fetch drops its pins
    assert s.match_pin("p1", "q", [1, 2, 3]) == 3  # pinned: the watermark eviction below must spare them
    s.put(list(range(10, 16)), _blocks(6, 5))
    assert all(h in s.store for h in (1, 2, 3)) and len(s.store) <= s.store.high_blocks
    s.check()
    assert s.release_owner("p1") == 1  # the instance died: its pins go
    s.check()
    s.put(list(range(20, 26)), _blocks(6, 6))
    s.check()  # evicted blocks' bytes went with them
    assert len(s.blocks) == len(s.store) <= s.store.high_blocks
    with pytest.raises(KeyError, match="fetch"):
        s.fetch("p0", "gone", 0, 1)
