"""Global KV store: LRU with Mooncake's watermarks, no eviction of blocks being read, layer-wise pipeline."""

from __future__ import annotations

import pytest

from kvbalance.kvcache.store import GlobalKVStore, StoreConfig, layerwise_pipeline_s
from kvbalance.specs import get_link


def _store(capacity_blocks: int = 100, **kw) -> GlobalKVStore:
    return GlobalKVStore(StoreConfig(capacity_bytes=capacity_blocks * 1000, **kw), bytes_per_block=1000)


def test_pipeline_is_max_of_compute_and_fetch_per_layer_plus_fill_and_drain():
    L = 40
    c, f, s = [2.0] * L, [3.0] * L, [1.0] * L  # fetch-bound
    assert layerwise_pipeline_s(c, f, s) == pytest.approx(L * 3.0 + 2.0 + 1.0)  # L max(c, f) + c + s
    assert layerwise_pipeline_s(c, f, s) == pytest.approx((L - 1) * max(2.0, 3.0, 1.0) + 2.0 + 3.0 + 1.0)
    c2 = [5.0] * L  # compute-bound: fetch fills, store drains
    assert layerwise_pipeline_s(c2, f, s) == pytest.approx(L * 5.0 + 3.0 + 1.0)
    assert layerwise_pipeline_s(c, f, s, overlap=False) == pytest.approx(L * 6.0)
    # one slow layer in the middle stalls only the layers behind it
    assert layerwise_pipeline_s([1.0, 1.0, 1.0], [1.0, 4.0, 1.0]) == pytest.approx(7.0)


def test_pipeline_rejects_ragged_or_negative_layers():
    with pytest.raises(ValueError, match="fetch_s"):
        layerwise_pipeline_s([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="must be >= 0"):
        layerwise_pipeline_s([1.0], [-1.0])


def test_match_finds_longest_stored_prefix():
    st = _store()
    st.put([1, 2, 3])
    assert st.match([1, 2, 3, 4]) == 3
    assert st.match([2, 3]) == 2  # hashes are chained, so any stored hash names its prefix
    assert st.match([9, 1]) == 0
    assert (st.hit_blocks, st.lookup_blocks) == (5, 8)


def test_watermarks_start_at_95_percent_and_free_5_percent():
    st = _store(100)
    chain = list(range(95))  # one prefix: block 0 is the root, 94 the leaf
    st.put(chain)
    assert len(st) == 95  # at the high watermark, not past it: nothing evicted
    st.put([1000])
    assert len(st) == 90 and st.num_evicted == 6  # past 95: down to 90
    # least recent first, and a put touches leaves before parents: the chain loses its tail 89..94
    assert 1000 in st and all(h in st for h in range(89)) and not any(h in st for h in range(89, 95))


def test_pinned_blocks_are_never_evicted():
    st = _store(100)
    st.put(list(range(95)))
    st.pin([94, 93, 92])  # the least recent blocks, being read
    st.put([1000])
    assert all(h in st for h in (94, 93, 92))
    assert len(st) == 90 and not any(h in st for h in range(86, 92)) and 85 in st
    st.unpin([94, 93, 92])
    with pytest.raises(RuntimeError, match="unpin without a pin"):
        st.unpin([94])
    with pytest.raises(KeyError):
        st.pin([12345])


def test_store_full_of_blocks_being_read_drops_new_puts():
    st = _store(10, high_watermark=1.0)
    st.put(list(range(10)))
    st.pin(list(range(10)))
    assert st.put([100]) == 0  # every block is being read: the put is dropped, nothing forced out
    assert st.num_dropped == 1 and len(st) == 10 and 100 not in st
    st.unpin([3])
    assert st.put([100]) == 1 and 3 not in st and 100 in st
    st.check_invariants()


def test_fetch_time_is_bytes_over_link_plus_latency():
    st = _store(100, link="pcie5")
    link = get_link("pcie5")
    assert st.fetch_s(7) == pytest.approx(link.latency_s + 7000 / link.bandwidth_bytes_s)
    assert st.fetch_s(0) == 0.0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="high_watermark"):
        StoreConfig(high_watermark=1.5)
    with pytest.raises(ValueError, match="capacity_bytes"):
        GlobalKVStore(StoreConfig(capacity_bytes=10), bytes_per_block=1000)
