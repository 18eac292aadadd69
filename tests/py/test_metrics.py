"""The Prometheus collector and the latency histograms it exports."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

import hicache
from hicache.metrics import HicacheCollector


def test_counters_gauges_and_latency_histograms_reach_prometheus() -> None:
    kv = np.zeros((8, 2, 16), np.float32)
    cache = hicache.HostPrefixCache(kv, block_tokens=16, capacity_pages=8)
    prompt = np.arange(40, dtype=np.int32)
    cache.store("a", prompt, list(range(8)))
    cache.poll()
    assert cache.try_resume("b", prompt, lambda n: list(range(n // 16))) == 32
    cache.poll()
    registry = CollectorRegistry()
    registry.register(HicacheCollector(cache, labels={"engine": "test"}))
    text = generate_latest(registry).decode()
    assert 'hicache_hits_total{engine="test"} 1.0' in text
    assert 'hicache_pages_stored_total{engine="test"} 2.0' in text
    assert 'hicache_pages_capacity{engine="test"} 8.0' in text
    # one load and one store, each in the histogram's count; cumulative buckets end at +Inf
    assert 'hicache_load_latency_seconds_count{engine="test"} 1.0' in text
    assert 'hicache_store_latency_seconds_count{engine="test"} 1.0' in text
    assert 'hicache_load_latency_seconds_bucket{engine="test",le="+Inf"} 1.0' in text
    s = cache.stats()
    assert sum(s.load_latency["counts"]) == 1 and s.load_latency["sum_us"] > 0


def test_a_shared_tier_is_counted() -> None:
    tier = hicache.MemoryTier()
    kv_a, kv_b = np.ones((8, 16), np.float32), np.zeros((8, 16), np.float32)
    a = hicache.HostPrefixCache(kv_a, block_tokens=16, capacity_pages=8, tier=tier)
    b = hicache.HostPrefixCache(kv_b, block_tokens=16, capacity_pages=8, tier=tier)
    prompt = np.arange(40, dtype=np.int32)
    a.store("a", prompt, list(range(8)))
    a.poll()
    a.flush_tier()
    assert b.try_resume("b", prompt, lambda n: list(range(n // 16))) == 32
    registry = CollectorRegistry()
    registry.register(HicacheCollector(a, labels={"host": "a"}))
    registry.register(HicacheCollector(b, labels={"host": "b"}))
    text = generate_latest(registry).decode()
    assert 'hicache_tier_pages_written_total{host="a"} 2.0' in text
    assert 'hicache_tier_pages_fetched_total{host="b"} 2.0' in text
    assert 'hicache_tier_hit_tokens_total{host="b"} 32.0' in text


def test_a_discarded_store_is_not_a_latency_sample() -> None:
    kv = np.zeros((8, 16), np.float32)
    cache = hicache.HostPrefixCache(kv, block_tokens=16, capacity_pages=8, copier="deferred")
    cache.store("a", np.arange(32, dtype=np.int32), [0, 1])
    cache.forget("a")  # in flight: discarded when it completes
    cache.complete_transfers()
    cache.poll()
    assert sum(cache.stats().store_latency["counts"]) == 0
    cache.store("b", np.arange(32, dtype=np.int32), [0, 1])
    cache.complete_transfers()
    cache.poll()
    assert sum(cache.stats().store_latency["counts"]) == 1  # negative control: a kept store counts


def test_a_callable_source_and_a_bad_source() -> None:
    registry = CollectorRegistry()
    registry.register(HicacheCollector(lambda: {"blocks_stored": 5, "used": 3}))
    text = generate_latest(registry).decode()
    assert "hicache_blocks_stored_total 5.0" in text and "hicache_used 3.0" in text
    with pytest.raises(TypeError, match="stats_dict"):
        HicacheCollector(42)
