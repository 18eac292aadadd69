"""hicache's vLLM manager alone (no engine): vLLM's calls in the order its scheduler makes them."""

from __future__ import annotations

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from hicache.vllm import HicacheLoadStoreSpec, HicacheManager


def keys(first: int, n: int) -> list:
    return [make_offload_key(f"block-{i}".encode(), 0) for i in range(first, first + n)]


def test_store_load_evict_with_events_named_as_vllm_names_them() -> None:
    m = HicacheManager(num_slots=4, eviction="leaf-first", admission="always", enable_events=True)
    ctx = ReqContext("r1")
    m.on_new_request(ctx)
    a = keys(0, 3)
    assert m.lookup(a[0], ctx) == LookupResult.MISS
    out = m.prepare_store(a, ctx)
    assert out is not None and out.keys_to_store == a and out.evicted_keys == []
    assert isinstance(out.store_spec, HicacheLoadStoreSpec) and len(out.store_spec.block_ids) == 3
    assert m.lookup(a[0], ctx) == LookupResult.HIT_PENDING
    m.complete_store(a, ctx)
    assert [m.lookup(k, ctx) for k in a] == [LookupResult.HIT] * 3
    spec = m.prepare_load(a, ctx)
    assert list(spec.block_ids) == list(out.store_spec.block_ids)
    m.complete_load(a, ctx)
    b = keys(10, 2)
    out_b = m.prepare_store(b, ctx)
    assert out_b is not None and out_b.evicted_keys == [a[2]]  # leaf first, named as vLLM named it
    m.complete_store(b, ctx)
    events = list(m.take_events())
    assert [(e.removed, e.keys) for e in events] == [(False, a), (True, [a[2]]), (False, b)]
    assert list(m.take_events()) == []
    stats = m.get_stats().reduce()
    assert stats["vllm:hicache_blocks_stored"] == 5 and stats["vllm:hicache_evictions"] == 1


def test_a_failed_store_is_removed_and_misses_cost_no_memory() -> None:
    m = HicacheManager(num_slots=8, eviction="leaf-first", admission="always", enable_events=False)
    ctx = ReqContext("r2")
    m.on_new_request(ctx)
    for k in keys(100, 1000):  # lookups of blocks hicache never held
        assert m.lookup(k, ctx) == LookupResult.MISS
    assert m._vllm_key == {}
    a = keys(0, 2)
    m.prepare_store(a, ctx)
    m.complete_store(a, ctx, success=False)
    assert m.lookup(a[0], ctx) == LookupResult.MISS
    assert m._vllm_key == {}  # names of removed blocks are dropped, events or not
    assert list(m.take_events()) == []  # vLLM did not ask for events


def test_second_sighting_admission_declines_a_first_offer_when_full() -> None:
    m = HicacheManager(num_slots=2, eviction="leaf-first", admission="second-sighting", enable_events=False)
    ctx = ReqContext("r3")
    m.on_new_request(ctx)
    first = keys(0, 2)
    m.complete_store(m.prepare_store(first, ctx).keys_to_store, ctx)
    other = keys(50, 2)
    assert m.prepare_store(other, ctx).keys_to_store == []  # seen once, pool full
    assert m.prepare_store(other, ctx).keys_to_store == other  # seen twice
