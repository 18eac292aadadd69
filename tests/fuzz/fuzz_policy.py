"""Coverage-guided fuzzing of the cache's entry points (atheris / libFuzzer).

Each input is decoded into a sequence of operations (try_resume with any block ids, including
out-of-range, duplicate and wrong-count ones; store with any block ids; poll; forget of known and
unknown ids; completing one stream or all), run on the C++ cache and on the pure-Python reference.
After every operation both must agree: the same return value or the same exception class, the
same counters, the same LRU order and the same engine bytes.

    python tests/fuzz/fuzz_policy.py -runs=20000 -max_len=512 -len_control=0   # as in CI
    python tests/fuzz/fuzz_policy.py corpus/                       # open-ended
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import atheris

with atheris.instrument_imports():
    import numpy as np

    import hicache
    from hicache.reference import ReferenceCache

B, BLOCKS = 4, 12


def give(ids: list[int], tokens: int) -> list[int]:
    return ids


def refuse(tokens: int) -> None:
    return None


PAGES = [np.arange(i * 100, i * 100 + B, dtype=np.int32) for i in range(4)]  # few pages: prefixes repeat


def outcome(fn: Callable[..., object], *args: object, **kwargs: object) -> tuple[str, object]:
    """("ok", result) or ("raise", the builtin exception class, e.g. KeyError for UnknownRequestError)."""
    try:
        return ("ok", fn(*args, **kwargs))
    except (ValueError, IndexError, KeyError, TypeError) as e:
        return ("raise", next(t for t in type(e).__mro__ if t.__module__ == "builtins"))


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    copier = "deferred" if fdp.ConsumeBool() else "cpu"
    capacity = fdp.ConsumeIntInRange(1, 8)
    eviction = "lru" if fdp.ConsumeBool() else "leaf-first"
    keep = fdp.ConsumeIntInRange(1, 6)
    seg_c = [np.zeros((BLOCKS, B, 2), np.uint8)]
    seg_r = [np.zeros((BLOCKS, B, 2), np.uint8)]
    kw = dict(block_tokens=B, capacity_pages=capacity, keep_tokens=keep, copier=copier, eviction=eviction)
    c = hicache.HostPrefixCache(seg_c, **kw)  # type: ignore[arg-type]
    r = ReferenceCache(seg_r, **kw)  # type: ignore[arg-type]
    for step in range(fdp.ConsumeIntInRange(0, 40)):
        op = fdp.ConsumeIntInRange(0, 4)
        rid = f"r{fdp.ConsumeIntInRange(0, 3)}"
        n_pages = fdp.ConsumeIntInRange(1, 5)
        prompt = np.concatenate(
            [PAGES[fdp.ConsumeIntInRange(0, 3)] for _ in range(n_pages)]
            + [np.arange(fdp.ConsumeIntInRange(0, B), dtype=np.int32)]
        )
        ids = [fdp.ConsumeIntInRange(-1, BLOCKS) for _ in range(fdp.ConsumeIntInRange(0, 6))]
        stream = fdp.ConsumeIntInRange(0, 1)
        pair = (c, r)
        if op == 0:
            for a in (seg_c, seg_r):
                a[0][...] = step % 251  # the engine rewrites its blocks between operations
            got = [outcome(x.store, rid, prompt, ids, stream=stream) for x in pair]
        elif op == 1:
            alloc = refuse if fdp.ConsumeBool() else functools.partial(give, ids)
            got = [outcome(x.try_resume, rid, prompt, alloc, stream=stream) for x in pair]
        elif op == 2:
            got = [outcome(x.poll) for x in pair]
        elif op == 3:
            got = [outcome(x.forget, rid) for x in pair]
        else:
            s = None if fdp.ConsumeBool() else stream
            got = [outcome(x.complete_transfers, s) if copier == "deferred" else ("ok", 0) for x in pair]
        assert got[0] == got[1], f"step {step} op {op}: C++ {got[0]} reference {got[1]}"
        sc, sr = c.stats(), r.stats()
        for k, v in sr.items():
            assert getattr(sc, k) == v, f"step {step} op {op}: {k} C++ {getattr(sc, k)} reference {v}"
        assert sc.pages_used <= capacity and sc.pages_busy <= sc.pages_used
        assert c.page_lru_order() == r.page_lru_order()
        assert np.array_equal(seg_c[0], seg_r[0]), f"step {step}: engine bytes differ"


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
