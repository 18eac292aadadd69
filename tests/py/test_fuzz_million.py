"""A million random operations, C++ cache against the reference, in CI.

The same comparison as test_differential.py (every return value, counter, LRU order, KV byte and
state buffer after every operation), over many seeds and every configuration axis: both copiers,
states on and off, weak keys (collisions), both eviction policies, every admission policy, tiny
pools that evict constantly.
"""

from __future__ import annotations

import itertools

from differential import run_differential

TOTAL_OPS = 1_000_000
STEPS = 5_000


def test_one_million_operations_match_the_reference() -> None:
    configs = list(
        itertools.product(
            ["cpu", "deferred"],
            [0, 24],
            [128, 5],
            [6, 11, 17],
            ["leaf-first", "lru"],
            ["always", "second-sighting", "adaptive"],
        )
    )
    done = hits = evictions = collisions = declined = 0
    for i in range(TOTAL_OPS // STEPS):  # 200 runs of 5,000 operations over 144 configurations
        copier, state_bytes, key_bits, capacity, eviction, admission = configs[(i * 7) % len(configs)]
        s = run_differential(copier, state_bytes, key_bits, capacity, 1000 + i, eviction, STEPS, admission)
        done += STEPS
        hits += s.hits
        evictions += s.pages_evicted
        collisions += s.collisions
        declined += s.pages_declined
    assert done >= TOTAL_OPS
    assert hits > 10_000 and evictions > 10_000 and collisions > 1_000 and declined > 1_000
