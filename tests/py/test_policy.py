"""The resume/store policy through the Python API: caps, states, deferral, eviction, salts."""

import numpy as np
import pytest

import hicache
from fake_engine import FakeEngine

B = 16


def make(capacity: int = 16, copier: str = "cpu", **kw: object) -> tuple[hicache.HostPrefixCache, FakeEngine]:
    eng = FakeEngine(32, B, [(B, 8)])
    return hicache.HostPrefixCache(
        eng.segments, block_tokens=B, capacity_pages=capacity, copier=copier, **kw
    ), eng


def test_keep_tokens_cap_leaves_at_least_that_many_tokens_to_compute() -> None:
    cache, _ = make(keep_tokens=1)
    cache.store("a", np.arange(3 * B), [0, 1, 2])
    assert cache.try_resume("b", np.arange(3 * B), lambda n: list(range(8, 8 + n // B))) == 2 * B
    assert cache.try_resume("c", np.arange(3 * B + 1), lambda n: list(range(8, 8 + n // B))) == 3 * B
    cache5, _ = make(keep_tokens=B + 5)
    cache5.store("a", np.arange(3 * B), [0, 1, 2])
    assert cache5.try_resume("b", np.arange(3 * B + 1), lambda n: list(range(8, 8 + n // B))) == B


def test_state_snaps_down_to_a_stored_boundary_and_is_copied_out() -> None:
    cache, _ = make(state_bytes=32, capacity_states=4, state_lookback=1)
    prompt = np.arange(4 * B + 3)
    states = {}

    def export(pos: int) -> np.ndarray:
        states[pos] = np.full(32, pos % 251, dtype=np.uint8)
        return states[pos]

    cache.store("a", prompt, list(range(5)), state_export=export)
    assert sorted(states) == [4 * B]
    out = np.zeros(32, dtype=np.uint8)
    assert cache.try_resume("b", prompt, lambda n: list(range(8, 8 + n // B)), state_out=out) == 4 * B
    assert (out == 4 * B % 251).all()
    # Same prefix, shorter: 3 pages match, but no state at 48, 32, 16: a miss, and state_out untouched.
    out[:] = 0
    assert (
        cache.try_resume("c", prompt[: 3 * B + 2], lambda n: list(range(8, 8 + n // B)), state_out=out) == 0
    )
    assert not out.any()


def test_refused_allocation_defers_and_a_retry_hits() -> None:
    cache, _ = make()
    cache.store("a", np.arange(2 * B + 1), [0, 1])
    assert cache.try_resume("b", np.arange(2 * B + 1), lambda n: None) == -1
    assert cache.stats().deferred == 1
    assert cache.stats().pages_busy == 0
    assert cache.try_resume("b", np.arange(2 * B + 1), lambda n: [5, 6]) == 2 * B


def test_in_flight_pages_are_protected_from_eviction_then_lru_applies() -> None:
    cache, eng = make(capacity=2, copier="deferred")
    a, b = np.arange(2 * B + 1), np.arange(2 * B + 1) + 100
    eng.prefill(a, [0, 1])
    assert cache.store("a", a, [0, 1]) == 2
    assert cache.try_resume("x", a, lambda n: [4, 5]) == 0  # not hit-able before completion
    assert cache.store("b", b, [2, 3]) == 0  # both slots held by the copy in flight
    assert cache.stats().store_skips == 1
    cache.complete_transfers()
    assert cache.poll() == 1
    assert cache.store("b", b, [2, 3]) == 2  # idle now: evicted
    assert cache.stats().pages_evicted == 2


def test_two_streams_complete_independently() -> None:
    cache, _ = make(copier="deferred")
    a, b = np.arange(B + 1), np.arange(B + 1) + 500
    cache.store("a", a, [0], stream=1)
    cache.store("b", b, [1], stream=2)
    cache.complete_transfers(2)
    assert cache.poll() == 1
    assert cache.try_resume("c", b, lambda n: [4]) == B
    assert cache.try_resume("d", a, lambda n: [5]) == 0
    cache.complete_transfers(1)
    assert cache.try_resume("e", a, lambda n: [5]) == B


def test_salts_keep_tenants_apart() -> None:
    cache, _ = make(salt="default-tenant")
    p = np.arange(2 * B + 1)
    cache.store("a", p, [0, 1, 2], salt=b"alice")
    assert cache.try_resume("b", p, lambda n: [4, 5], salt=b"bob") == 0
    assert cache.try_resume("c", p, lambda n: [4, 5]) == 0
    assert cache.try_resume("d", p, lambda n: [4, 5], salt="alice") == 2 * B


def test_forget_discards_a_store_still_in_flight() -> None:
    cache, _ = make(copier="deferred")
    p = np.arange(2 * B + 1)
    cache.store("a", p, [0, 1])
    cache.forget("a")
    cache.complete_transfers()
    cache.poll()
    assert cache.stats().pages_used == 0
    assert cache.try_resume("b", p, lambda n: [4, 5]) == 0
    with pytest.raises(hicache.UnknownRequestError):
        cache.forget("a")
    with pytest.raises(KeyError):  # UnknownRequestError is a KeyError
        cache.forget("never-seen")


def test_stats_report_every_deepinfer_counter_and_rates() -> None:
    cache, _ = make(capacity=2)
    p = np.arange(2 * B + 1)
    cache.store("a", p, [0, 1])
    cache.try_resume("b", p, lambda n: [4, 5])
    cache.try_resume("c", p + 1000, lambda n: [4, 5])
    cache.store("d", p + 1000, [2, 3])
    assert cache.stats().pages_stored == 2  # a store counts once its copy is retired...
    cache.poll()  # ...as stored when published (or as discarded)
    s = cache.stats()
    assert (s.lookups, s.hits, s.hit_tokens, s.deferred) == (2, 1, 2 * B, 0)
    assert (s.stores, s.store_skips, s.pages_stored, s.pages_loaded, s.pages_evicted) == (2, 0, 4, 2, 2)
    assert (s.states_stored, s.states_loaded, s.states_evicted, s.errors) == (0, 0, 0, 0)
    assert s.hit_rate == pytest.approx(0.5)
    assert s.token_hit_rate == pytest.approx(2 * B / (2 * len(p)))
    assert s.disabled is False and s.disabled_reason == ""
    d = cache.stats_dict()
    assert d["hits"] == 1 and d["hit_rate"] == pytest.approx(0.5)
