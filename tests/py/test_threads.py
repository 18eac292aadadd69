"""Several engine threads on one hybrid cache from Python, checked against the truth.

Each thread has its own blocks and its own ``state_out``; prompts overlap (two letters, 1-6
pages), two salts, and a state pool of 8 so states are evicted constantly. The engine returns a
fresh array from every ``state_export`` call, which the cache must keep alive until it copied it:
the binding once kept only the (consumed) DLPack capsule, so the array was freed before the copy
and another thread's array, allocated in its place, was stored as this prefix's state.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time

import numpy as np
import pytest

import hicache

B = 4
BLOCKS = 8  # per thread: prompts of up to 6 pages
STATE = 16


def page_bytes(prompt: list[int], page: int, salt: bytes) -> np.ndarray:
    """A page's KV: a digest of the whole prefix up to its end (it depends on every token before)."""
    h = hashlib.blake2b(bytes(prompt[: (page + 1) * B]), digest_size=32, key=salt, person=b"page")
    return np.frombuffer(h.digest(), dtype=np.uint8)


def state_bytes(prompt: list[int], end: int, salt: bytes) -> np.ndarray:
    h = hashlib.blake2b(bytes(prompt[:end]), digest_size=STATE, key=salt, person=b"state")
    return np.frombuffer(h.digest(), dtype=np.uint8).copy()  # a fresh, writable array


def hammer(threads: int, seconds: float, fresh_exports: bool) -> dict[str, int]:
    kv = np.zeros((threads * BLOCKS, 32), dtype=np.uint8)
    cache = hicache.HostPrefixCache(
        kv, block_tokens=B, capacity_pages=24, state_bytes=STATE, capacity_states=8, state_lookback=3
    )
    counts = {"hits": 0, "wrong_pages": 0, "wrong_states": 0, "errors": 0}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def engine(t: int) -> None:
        rng = random.Random(t)
        blocks = list(range(t * BLOCKS, (t + 1) * BLOCKS))
        out = np.zeros(STATE, dtype=np.uint8)
        staging = np.zeros(STATE, dtype=np.uint8)
        mine = dict.fromkeys(counts, 0)
        n = 0
        while time.monotonic() < end:
            n += 1
            rid = f"{t}:{n}"
            salt = rng.choice([b"", b"tenant-b"])
            pages = rng.randint(1, 6)
            prompt = [rng.randint(1, 2) for _ in range(pages * B + rng.randint(1, 3))]
            try:
                if rng.random() < 0.5:
                    for p in range(pages):
                        kv[blocks[p]] = page_bytes(prompt, p, salt)

                    def export(pos: int, prompt: list[int] = prompt, salt: bytes = salt) -> np.ndarray:
                        if fresh_exports:
                            return state_bytes(prompt, pos, salt)
                        staging[:] = state_bytes(prompt, pos, salt)
                        return staging

                    cache.store(rid, prompt, blocks, state_export=export, salt=salt)
                else:
                    out[:] = 0xEE
                    got = cache.try_resume(rid, prompt, lambda k: blocks[: k // B], state_out=out, salt=salt)
                    if got > 0:
                        mine["hits"] += 1
                        for p in range(got // B):
                            if not np.array_equal(kv[blocks[p]], page_bytes(prompt, p, salt)):
                                mine["wrong_pages"] += 1
                        # Copies are synchronous on the CPU: the state of exactly prompt[:got].
                        if not np.array_equal(out, state_bytes(prompt, got, salt)):
                            mine["wrong_states"] += 1
                if rng.random() < 0.3:
                    cache.poll()
                cache.forget(rid)
            except Exception:  # noqa: BLE001 - counted: no call of this workload may raise
                mine["errors"] += 1
        with lock:
            for k, v in mine.items():
                counts[k] += v

    workers = [threading.Thread(target=engine, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    s = cache.stats()
    counts["states_evicted"] = s.states_evicted
    counts["busy"] = s.pages_busy + s.states_busy
    return counts


@pytest.mark.parametrize("threads", [4, 8])
def test_threads_on_one_hybrid_cache_get_exactly_their_prefixs_pages_and_state(threads: int) -> None:
    c = hammer(threads, 2.0, fresh_exports=True)
    print(c)
    assert c["errors"] == 0
    assert c["hits"] > 500, c  # enough hits to have raced
    assert c["states_evicted"] > 500, c  # the state pool turns over
    assert c["wrong_pages"] == 0, c
    assert c["wrong_states"] == 0, c
    assert c["busy"] == 0


def test_the_check_catches_a_state_of_another_prefix() -> None:
    # Negative control of the check: the digests tell prefixes, positions and salts apart.
    a = [1, 1, 2, 2, 1, 2, 1, 1, 2]
    b = [2, *a[1:]]
    assert not np.array_equal(state_bytes(a, 8, b""), state_bytes(b, 8, b""))
    assert not np.array_equal(state_bytes(a, 8, b""), state_bytes(a, 8, b"tenant-b"))
    assert not np.array_equal(state_bytes(a, 8, b""), state_bytes(a, 4, b""))
    assert not np.array_equal(page_bytes(a, 1, b""), page_bytes(b, 1, b""))  # same page, other prefix
