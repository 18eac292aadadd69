"""Thousands of random operations on the C++ cache and on the pure-Python reference.

After every operation the return values, every counter, the LRU order, the engine's KV bytes
and the state buffers must be identical.
"""

from __future__ import annotations

import pytest

from differential import run_differential


@pytest.mark.parametrize(
    "copier,state_bytes,key_bits,capacity,seed,eviction,admission",
    [
        ("cpu", 0, 128, 12, 1, "leaf-first", "always"),
        ("deferred", 0, 128, 10, 2, "leaf-first", "always"),
        ("deferred", 24, 128, 14, 3, "leaf-first", "always"),
        ("cpu", 24, 5, 12, 4, "leaf-first", "always"),
        ("deferred", 0, 4, 9, 5, "leaf-first", "always"),
        ("deferred", 40, 128, 30, 6, "leaf-first", "always"),
        ("cpu", 0, 128, 12, 7, "lru", "always"),
        ("deferred", 24, 128, 14, 8, "lru", "always"),
        ("deferred", 0, 4, 9, 9, "lru", "always"),
        ("cpu", 0, 128, 12, 10, "leaf-first", "second-sighting"),
        ("deferred", 24, 128, 14, 11, "leaf-first", "second-sighting"),
        ("deferred", 0, 4, 9, 12, "lru", "second-sighting"),
        ("cpu", 0, 128, 12, 13, "leaf-first", "adaptive"),
        ("deferred", 24, 128, 14, 14, "leaf-first", "adaptive"),
        ("deferred", 0, 128, 9, 15, "lru", "adaptive"),
    ],
)
def test_cpp_cache_matches_the_reference_over_random_operations(
    copier: str, state_bytes: int, key_bits: int, capacity: int, seed: int, eviction: str, admission: str
) -> None:
    s = run_differential(copier, state_bytes, key_bits, capacity, seed, eviction, 2500, admission)
    # The run must have exercised the interesting paths, or it proves little.
    assert s.hits > 20 and s.pages_evicted > 0 and s.deferred > 0
    if state_bytes:
        assert s.states_loaded > 0
    if key_bits < 128:
        assert s.collisions > 0
    if admission != "always":
        assert s.pages_declined > 0  # the admission path ran, not only the free-slot shortcut


@pytest.mark.parametrize(
    "copier,state_bytes,capacity,seed,eviction,admission",
    [
        ("cpu", 0, 80, 21, "leaf-first", "always"),
        ("deferred", 24, 70, 22, "leaf-first", "always"),
        ("deferred", 0, 40, 23, "lru", "second-sighting"),
        ("cpu", 0, 60, 24, "leaf-first", "adaptive"),
        ("deferred", 24, 45, 25, "leaf-first", "adaptive"),
    ],
)
def test_long_prompts_stored_in_installments_match_the_reference(
    copier: str, state_bytes: int, capacity: int, seed: int, eviction: str, admission: str
) -> None:
    # Prompts of 16-60 pages: a store hashes, admits and copies 16 pages, then 16, then 32 (one
    # copy operation each), and the reference does the same, page for page and op for op.
    stored: list[int] = []
    s = run_differential(
        copier, state_bytes, 128, capacity, seed, eviction, 1500, admission, long_prompts=True, stored=stored
    )
    assert s.hits > 20 and s.pages_evicted > 0
    assert max(stored) > 16  # some stores copied pages in two installments or more
    if admission != "always":
        assert s.pages_declined > 0
