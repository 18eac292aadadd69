"""Hostile input, class by class: each test failed (a crash, a broken promise, unbounded memory,
an unclear error) before the fix it guards, and each guard is shown to have teeth."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hicache

torch = pytest.importorskip("torch")
B = 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- a segment whose storage changes after construction ------------------------------------------

RESIZE_SCRIPT = """
import torch, hicache
t = torch.zeros(4, 1 << 16)
cache = hicache.HostPrefixCache(t, block_tokens=16, capacity_pages=4)
cache.store("old", list(range(100, 133)), [2, 3])
{disable}
t.resize_(64, 1 << 16)   # reallocates: the cache's pointer now dangles
t[0] = 5.0               # in the new memory
try:
    cache.store("a", list(range(17)), [0])
    cache.poll()
    cache.try_resume("b", list(range(17)), lambda n: [2])
    print("served right bytes" if bool((t[2] == 5.0).all()) else "served wrong bytes")
except ValueError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("change", ["resize_", "set_"])
def test_a_segment_reallocated_after_construction_is_refused_by_name(change) -> None:
    t = torch.zeros(4, 1 << 16)
    cache = hicache.HostPrefixCache([torch.zeros(4, 8), t], block_tokens=B, capacity_pages=4)
    cache.store("old", list(range(2 * B + 1)), [0, 1])
    if change == "resize_":
        t.resize_(64, 1 << 16)
    else:
        t.set_(torch.zeros(4, 1 << 16))
    with pytest.raises(ValueError, match="segment 1 no longer points to the memory"):
        cache.store("a", list(range(100, 100 + 2 * B + 1)), [0, 1])
    with pytest.raises(ValueError, match="segment 1 no longer points"):  # a hit, about to copy
        cache.try_resume("b", list(range(2 * B + 1)), lambda n: [2, 3][: n // B])
    assert cache.try_resume("c", list(range(500, 600)), lambda n: [2, 3]) == 0  # a miss copies nothing
    assert cache.stats().pages_busy == 0


def run_child(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120
    )


def test_the_reallocation_guard_has_teeth() -> None:
    # With the guard the call is refused by name; without it (the negative control, run in a
    # child), the copies go through the dangling pointer: the page served is not what the tensor
    # holds, or the process dies (on this project's CPU machine it segfaults).
    guarded = run_child(RESIZE_SCRIPT.format(disable=""))
    assert guarded.returncode == 0, guarded.stderr
    assert "refused: segment 0 no longer points" in guarded.stdout
    unguarded = run_child(RESIZE_SCRIPT.format(disable="cache._check_segments = lambda: None"))
    outcome = (unguarded.returncode, unguarded.stdout, unguarded.stderr[-500:])
    assert unguarded.returncode < 0 or "served wrong bytes" in unguarded.stdout, outcome


def test_a_numpy_segment_cannot_be_resized_under_the_cache() -> None:
    arr = np.zeros((4, 64), np.float32)
    cache = hicache.HostPrefixCache(arr, block_tokens=B, capacity_pages=4)
    with pytest.raises(ValueError, match="cannot resize"):
        arr.resize((64, 64))
    assert cache.store("a", list(range(B + 1)), [0]) == 1


# --- a __dlpack__ that hands out the same capsule twice -------------------------------------------


class SameCapsuleTwice:
    """A buggy producer: __dlpack__ always returns the one capsule it made first."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        self.capsule = arr.__dlpack__()

    def __dlpack__(self, *args: object, **kwargs: object) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def test_a_capsule_handed_out_twice_gets_one_owner() -> None:
    seg = SameCapsuleTwice(np.zeros((8, 64), np.float32))
    first = hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=4)
    with pytest.raises(
        ValueError, match="segment 0: its __dlpack__\\(\\) returned a capsule that was already consumed"
    ):
        hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=4)
    state = SameCapsuleTwice(np.full(16, 3, np.uint8))
    cache = hicache.HostPrefixCache(
        np.zeros((8, 64), np.float32),
        block_tokens=B,
        capacity_pages=8,
        state_bytes=16,
        capacity_states=4,
        state_lookback=1,
    )
    cache.store("a", list(range(2 * B + 1)), [0, 1], state_export=lambda pos: state)
    with pytest.raises(
        ValueError, match=r"state_export\(\d+\)'s result: its __dlpack__\(\) returned a capsule"
    ):
        cache.store("b", list(range(100, 100 + 2 * B + 1)), [2, 3], state_export=lambda pos: state)
    out = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="state_out: its __dlpack__\\(\\) returned a capsule"):
        cache.try_resume("c", list(range(2 * B + 1)), lambda n: [4, 5][: n // B], state_out=state)
    assert cache.try_resume("c", list(range(2 * B + 1)), lambda n: [4, 5][: n // B], state_out=out) == 2 * B
    assert (out == 3).all()
    del first, cache
    gc.collect()  # two owners of one capsule would free it twice here


# --- a store that raises publishes nothing --------------------------------------------------------


@pytest.mark.parametrize("how", ["wrong size", "wrong type", "raises", "polls then wrong size"])
def test_a_store_that_raises_publishes_nothing(how) -> None:
    seg = torch.zeros(8, B, 4)
    cache = hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=8, state_bytes=16, capacity_states=4)
    prompt = torch.arange(3 * B + 1)

    def export(pos: int) -> object:
        if how == "wrong size":
            return torch.zeros(5, dtype=torch.uint8)
        if how == "wrong type":
            return "a state"
        if how == "raises":
            raise RuntimeError("engine: no snapshot")
        cache.poll()  # re-entrant: must not publish the pages already copied
        return torch.zeros(5, dtype=torch.uint8)

    with pytest.raises((ValueError, TypeError, RuntimeError)) as err:
        cache.store("a", prompt, [0, 1, 2], state_export=export)
    if how == "raises":
        assert "engine: no snapshot" in str(err.value)  # the engine's own error, unchanged
    else:
        assert "state_export" in str(err.value)
    cache.poll()
    s = cache.stats()
    assert (s.pages_used, s.states_used, s.pages_busy, s.transfers_in_flight) == (0, 0, 0, 0)
    # Counters count what happened: its three pages were copied and thrown away, never stored.
    assert (s.pages_stored, s.states_stored, s.pages_discarded) == (0, 0, 3)
    out = torch.zeros(16, dtype=torch.uint8)
    assert cache.try_resume("b", prompt, lambda n: [3, 4, 5][: n // B], state_out=out) == 0


# --- memory stays bounded -------------------------------------------------------------------------


def test_a_million_lookups_with_distinct_salts_and_request_ids_keep_memory_flat() -> None:
    cache = hicache.HostPrefixCache(torch.zeros(8, B, 4), block_tokens=B, capacity_pages=4)
    prompt = np.arange(2 * B + 1, dtype=np.int32)
    pad = b"x" * 1000  # 1 KB salts: a million kept would be a gigabyte
    for i in range(20_000):  # warm up the allocator before the baseline
        cache.try_resume(i, prompt, lambda n: None, salt=pad + str(i).encode())
        cache.forget(i)
    before = rss_bytes()
    for i in range(1_000_000):
        cache.try_resume(i, prompt, lambda n: None, salt=pad + str(i).encode())
        cache.forget(i)
        if i % 50_000 == 0:  # stores under per-request salts too, evicted as they go
            cache.store(i, prompt, [0, 1], salt=pad + str(i).encode())
            cache.forget(i)
    grown = rss_bytes() - before
    s = cache.stats()
    assert s.lookups == 1_020_000 and s.requests == 0
    assert s.salts <= 64 + 2 * s.pages_used
    assert grown < 32 << 20, f"RSS grew by {grown >> 20} MiB over a million lookups"


def test_the_rss_measure_sees_a_leak_of_that_size() -> None:
    # The positive control of the test above: keeping 100,000 salts of 1 KB (a tenth of what a
    # leak of every salt would keep) grows RSS past its 32 MiB bound.
    before = rss_bytes()
    kept = [b"x" * 1000 + str(i).encode() for i in range(100_000)]
    assert rss_bytes() - before > 32 << 20
    del kept


@pytest.mark.parametrize("capacity", [2**32, 2**40, 2**63 - 1])
def test_huge_capacities_cost_nothing_while_idle(capacity) -> None:
    seg = torch.zeros(8, B, 256)  # 16 KiB pages
    before = rss_bytes()
    cache = hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=capacity)
    assert rss_bytes() - before < 8 << 20
    assert cache.store("a", list(range(2 * B + 1)), [0, 1]) == 2
    assert cache.try_resume("b", list(range(2 * B + 1)), lambda n: [2, 3][: n // B]) == 2 * B


# --- errors that name the argument ----------------------------------------------------------------


class RaisingProducer:
    def __dlpack__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("engine: export failed")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def read_only(shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    a = np.zeros(shape, dtype)
    a.flags.writeable = False
    return a


def byte_strided() -> np.ndarray:
    base = np.zeros(8 * 64, np.uint8)
    return np.ndarray((8, 16), dtype=np.float32, buffer=base, offset=0, strides=(62, 4))


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: [read_only((8, 64))], ValueError, "segment 0 is read-only"),
        (
            lambda: [torch.zeros(8, 4), byte_strided()],
            ValueError,
            "segment 1 cannot be exported through DLPack",
        ),
        (
            lambda: [RaisingProducer()],
            ValueError,
            "segment 0: its __dlpack__\\(\\) raised RuntimeError: engine",
        ),
        (lambda: [torch.zeros(8, 4), None], TypeError, "segment 1 is None"),
        (lambda: [torch.zeros(0, 4)], ValueError, "segment 0 has no blocks"),
        (lambda: [torch.zeros(8, 0)], ValueError, "segment 0: its blocks hold no bytes"),
        (lambda: [torch.zeros(8, 4, device="meta")], ValueError, "segment 0 is a meta tensor"),
        (lambda: "kv", TypeError, "segments must be a tensor or a sequence of tensors"),
    ],
)
def test_bad_segments_are_named(make, exc, match) -> None:
    with pytest.raises(exc, match=match):
        hicache.HostPrefixCache(make(), block_tokens=B, capacity_pages=4)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(host_bytes=1e6), TypeError, r"host_bytes must be an int, not float \(1000000.0\)"),
        (dict(capacity_pages=4.0), TypeError, "capacity_pages must be an int, not float"),
        (dict(capacity_pages=2**64), ValueError, "capacity_pages must be <="),
        (dict(capacity_pages=4, block_tokens="16"), TypeError, "block_tokens must be an int, not str"),
        (dict(capacity_pages=4, keep_tokens=True), TypeError, "keep_tokens must be an int, not bool"),
        (dict(capacity_pages=4, pin_upfront=1), TypeError, "pin_upfront must be a bool"),
        (dict(capacity_pages=4, cuda_blocks=2**40), ValueError, "cuda_blocks must be <= 1024"),
        (dict(capacity_pages=4, eviction=3), ValueError, "eviction must be one of"),
        (dict(capacity_pages=4, salt=3), TypeError, "salt must be bytes or str"),
        (dict(capacity_pages=4, salt="\udc80"), ValueError, "salt .* cannot be encoded as UTF-8"),
    ],
)
def test_bad_keywords_are_named(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        hicache.HostPrefixCache(torch.zeros(8, B, 4), block_tokens=kwargs.pop("block_tokens", B), **kwargs)


@pytest.fixture
def state_cache() -> hicache.HostPrefixCache:
    return hicache.HostPrefixCache(
        torch.zeros(8, B, 4), block_tokens=B, capacity_pages=8, state_bytes=16, capacity_states=4
    )


def test_bad_call_arguments_are_named(state_cache) -> None:
    c = state_cache
    prompt = list(range(2 * B + 1))
    out = torch.zeros(16, dtype=torch.uint8)
    cases = [
        (
            lambda: c.try_resume("\ud800", prompt, lambda n: [0, 1], state_out=out),
            ValueError,
            "request_id .* UTF-8",
        ),
        (lambda: c.forget("\ud800"), ValueError, "request_id"),
        (
            lambda: c.try_resume("a", prompt, lambda n: [0, 1], state_out=read_only((16,), np.uint8)),
            ValueError,
            "state_out is read-only",
        ),
        (
            lambda: c.try_resume("a", prompt, lambda n: [0, 1], state_out="x"),
            TypeError,
            "state_out must be a tensor",
        ),
        (lambda: c.try_resume("a", prompt, [0, 1], state_out=out), TypeError, "allocate must be a callable"),
        (
            lambda: c.try_resume("a", prompt, lambda n: [0, 1], state_out=out, stream=2**64),
            ValueError,
            "stream",
        ),
        (
            lambda: c.try_resume(
                "a", torch.zeros(40, dtype=torch.int64, device="meta"), lambda n: [0, 1], state_out=out
            ),
            ValueError,
            "prompt is a meta tensor",
        ),
        (
            lambda: c.try_resume("a", [2**70] * 40, lambda n: [0, 1], state_out=out),
            ValueError,
            "prompt holds integers",
        ),
        (
            lambda: c.store("a", prompt, [0, 1], state_export=torch.zeros(16)),
            TypeError,
            "state_export must be a callable",
        ),
        (
            lambda: c.store("a", prompt, [0, 1], state_export=lambda p: read_only((5,), np.uint8)),
            ValueError,
            r"state_export\(32\) must return 16 bytes",
        ),
        (lambda: c.complete_transfers(1.5), TypeError, "stream must be an int"),
        (lambda: hicache.chain_keys(prompt, 16.0), TypeError, "block_tokens must be an int, not float"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
