"""Mooncake Store as hicache's tier: hicache's put/get against the Mooncake client's own.

Needs a running mooncake_master (see hicache.mooncake) and ``pip install hicache[mooncake]``.
Two clients as two engine hosts would have: A writes, B reads (B's values come from A's segment).
Measured side by side in one run, same pages and sizes:

- raw: the client's own zero-copy batch_upsert_from (A) and batch_get_into (B) of the same bytes
  from registered buffers, and that get followed by a copy into the engine's blocks (what an
  engine using the client by itself does: its blocks are not registered memory);
- hicache: from cache A's store() completing until its pages are written (poll, flush_tier:
  each page's record written after it in its host slot, put from there), cache B's try_resume
  of the prompt missing in its host memory (hash, fetch into host slots, check every record,
  load into the engine's blocks, checking each page's bytes as the CPU copier copies them), and
  cache D's prefetch of it (hash, fetch into host slots, check the records; no load).

    python bench/tier_mooncake.py --pages 64 --page-kib 1024 --reps 7

``--device cuda`` keeps the engines' KV on the GPU, as an engine's is: a store then copies from
the GPU into host slots and ``try_resume`` loads into GPU blocks (the time includes waiting for
that load). The raw client's get of one page is timed too, beside the added latency of a tier hit.
``--phases`` also splits hicache's put, try_resume and prefetch into the time before the client's
first call, inside the client's calls, between them, and after the last one (medians, ms), and
try_resume's time after the last get into its parts, beside a host hit of the same pages.

Odd repetitions run hicache's part first, even ones the raw client's, and the median repetition's
ratios are also printed by order: whichever runs second meets the link, the master and the
segments as the other left them.

The link on this kind of machine (two clients over loopback TCP on 2 cores) swings by tens of
percent from one call to the next, so the table gives medians, with the best in parentheses.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import hicache
from hicache.mooncake import MooncakeTier


class TimedTier(MooncakeTier):
    """A MooncakeTier that notes when each of the client's calls starts and ends (--phases)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[float, float]] = []

    def _call(self, call: str, n: int, *args: Any) -> list[int]:
        t = time.perf_counter()
        try:
            return super()._call(call, n, *args)
        finally:
            if call != "batch_is_exist":
                self.calls.append((t, time.perf_counter()))


def phases(tier: TimedTier, t0: float, t1: float) -> tuple[float, float, float, float]:
    """(before the first client call, inside calls, between them, after the last), seconds."""
    inside = [(a, b) for a, b in tier.calls if a >= t0 and b <= t1]
    tier.calls.clear()
    if not inside:
        return (t1 - t0, 0.0, 0.0, 0.0)
    busy = sum(b - a for a, b in inside)
    first, last = inside[0][0], max(b for _, b in inside)
    return (first - t0, busy, (last - first) - busy, t1 - last)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", default="127.0.0.1:50051")
    ap.add_argument("--metadata", default="http://127.0.0.1:8080/metadata")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-kib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the engines' KV lives")
    ap.add_argument("--phases", action="store_true", help="also split hicache's calls (see above)")
    args = ap.parse_args()
    B, page, n = 16, args.page_kib << 10, args.pages
    # Each client lends enough for every value of every repetition (raw and hicache's, twice over):
    # a full store refuses puts and later reads miss.
    seg = max(16, 2 * args.reps + 2) * n * (page + 4096)
    ta = TimedTier(args.master, args.metadata, segment_bytes=seg)
    tb = TimedTier(args.master, args.metadata, segment_bytes=seg)
    rng = np.random.default_rng(0)
    kv_a = rng.integers(0, 256, (n, page), dtype=np.uint8)
    kv_b = np.zeros_like(kv_a)
    sync = lambda: None  # noqa: E731
    if args.device == "cuda":
        import torch

        kv_a, kv_b = torch.from_numpy(kv_a).cuda(), torch.from_numpy(kv_b).cuda()
        sync = torch.cuda.synchronize
    same = (lambda x, y: bool((x == y).all())) if args.device == "cuda" else np.array_equal
    # The raw client: buffers registered once, as hicache's are.
    src = rng.integers(0, 256, n * page, dtype=np.uint8)
    dst = np.zeros_like(src)
    # The raw client's values then go into the engine's blocks, as an engine using the client by
    # itself would have to (blocks are not registered memory): pinned for a GPU engine's copy.
    if args.device == "cuda":
        dst_t = torch.empty(n * page, dtype=torch.uint8).pin_memory()
        dst = dst_t.numpy()

        def to_engine() -> None:
            kv_b.view(-1).copy_(dst_t, non_blocking=True)
            torch.cuda.synchronize()
    else:
        # On every core, as hicache's CPU copier does (numpy releases the GIL while it copies).
        k = min(8, os.cpu_count() or 1)
        pool = ThreadPoolExecutor(k)
        parts = list(zip(np.array_split(kv_b.reshape(-1), k), np.array_split(dst, k), strict=True))

        def to_engine() -> None:
            list(pool.map(lambda p: np.copyto(p[0], p[1]), parts))

    ta._store.register_buffer(src.ctypes.data, src.nbytes)
    tb._store.register_buffer(dst.ctypes.data, dst.nbytes)
    # Fill both clients' segments once and empty them: a value written into segment memory never
    # touched before pays the kernel's page faults (a fresh master and fresh segments made the
    # raw client's put median swing from 1.0 to 2.0 GB/s between runs).
    for w in range(2 * seg // (n * page) - 1):
        names = [f"warm/{w}/{i}" for i in range(n)]
        ta._store.batch_upsert_from(names, [src.ctypes.data + i * page for i in range(n)], [page] * n)
    ta._store.remove_all()
    # Caches live across repetitions, as an engine's do (their buffers are warm after the first).
    a = hicache.HostPrefixCache(kv_a, block_tokens=B, capacity_pages=n, tier=ta, admission="always")
    b = hicache.HostPrefixCache(kv_b, block_tokens=B, capacity_pages=n, tier=tb, tier_wait_ms=60_000)
    one_kv = kv_b[:1].clone() if args.device == "cuda" else np.zeros((1, page), np.uint8)
    c = hicache.HostPrefixCache(one_kv, block_tokens=B, capacity_pages=4, tier=tb, tier_wait_ms=60_000)
    # Prefetching: the tier's pages into host memory only (no load into the engine's blocks).
    d = hicache.HostPrefixCache(
        kv_b.clone() if args.device == "cuda" else np.zeros_like(kv_b),
        block_tokens=B,
        capacity_pages=n,
        tier=tb,
        tier_wait_ms=0,
    )
    rows = []

    def raw_part(rep: int) -> tuple[float, float, float, float]:
        """The raw client's put, get, get and copy into the engine's blocks, one-page get (s)."""
        names = [f"raw/{rep}/{i}" for i in range(n)]
        t = time.perf_counter()
        assert (
            min(
                ta._store.batch_upsert_from(names, [src.ctypes.data + i * page for i in range(n)], [page] * n)
            )
            >= 0
        )
        raw_put = time.perf_counter() - t
        t = time.perf_counter()
        got = tb._store.batch_get_into(names, [dst.ctypes.data + i * page for i in range(n)], [page] * n)
        raw_get = time.perf_counter() - t
        assert min(got) == page and np.array_equal(src, dst)
        t = time.perf_counter()
        to_engine()
        raw_get_load = raw_get + time.perf_counter() - t
        t = time.perf_counter()
        assert tb._store.batch_get_into(names[:1], [dst.ctypes.data], [page]) == [page]
        raw_one = time.perf_counter() - t
        return raw_put, raw_get, raw_get_load, raw_one

    def hicache_part(rep: int, a: Any, b: Any, c: Any, d: Any) -> tuple[Any, ...]:
        """hicache's put, try_resume and prefetch of the same bytes, and a one-page tier hit."""
        prompt = np.arange(n * B + 1, dtype=np.int32) + rep * 1_000_000
        written = a.stats().tier_pages_written
        assert a.store(f"a{rep}", prompt, list(range(n))) == n
        sync()  # the store's copies out of the engine's blocks (GPU) are done
        t = time.perf_counter()  # from the store's completion: poll() queues its pages
        a.poll()
        a.flush_tier()
        hc_put = time.perf_counter() - t
        put_phases = phases(ta, t, t + hc_put)
        assert a.stats().tier_pages_written == written + n, a.stats().tier_last_error
        kv_b[:] = 0
        sync()
        allocated: list[float] = []

        def allocate(k: int, allocated: list[float] = allocated) -> list[int]:
            allocated.append(time.perf_counter())
            return list(range(k // B))

        t = time.perf_counter()
        served = b.try_resume(f"b{rep}", prompt, allocate)
        returned = time.perf_counter()
        sync()  # the load into the engine's blocks is part of the hit
        hc_get = time.perf_counter() - t
        last_get = max((e for _, e in tb.calls if e <= t + hc_get), default=t)
        get_phases = phases(tb, t, t + hc_get)
        assert served == n * B and same(kv_a, kv_b), (served, b.stats().tier_last_error)
        # The after-phase, split: until the engine's blocks are asked for (records checked,
        # pages published, the walk), until try_resume returns (the load enqueued, the pages'
        # bytes checked), until the load is done; and a host hit of the same pages (the load
        # alone: its pages are checked now).
        t_host = time.perf_counter()
        assert b.try_resume(f"b2{rep}", prompt, lambda k: list(range(k // B))) == n * B
        sync()
        after_split = (
            allocated[0] - last_get,
            returned - allocated[0],
            t + hc_get - returned,
            time.perf_counter() - t_host,
        )
        fetched = d.stats().tier_pages_fetched
        t = time.perf_counter()
        assert d.try_resume(f"d{rep}", prompt, lambda k: list(range(k // B))) == 0
        d.flush_tier()
        hc_fetch = time.perf_counter() - t
        fetch_phases = phases(tb, t, t + hc_fetch)
        assert d.stats().tier_pages_fetched == fetched + n, d.stats().tier_last_error
        # Added latency of a tier hit for one page, against a host hit of the same page.
        one = prompt[: B + 1] + 7
        a.store(f"one{rep}", one, [0])
        sync()
        a.poll()
        a.flush_tier()
        t = time.perf_counter()
        assert c.try_resume(f"c{rep}", one, lambda k: [0]) == B
        sync()
        tier_hit = time.perf_counter() - t
        t = time.perf_counter()
        assert c.try_resume(f"c2{rep}", one, lambda k: [0]) == B
        sync()
        host_hit = time.perf_counter() - t
        return (
            hc_put,
            put_phases,
            hc_get,
            get_phases,
            after_split,
            hc_fetch,
            fetch_phases,
            tier_hit - host_hit,
        )

    # Half the repetitions run the raw client first, half hicache first: whichever goes second
    # meets the link, the master and the segments as the first one left them. The ratios by
    # order are printed too, so an order effect shows instead of leaning one way.
    for rep in range(args.reps):
        raw_first = rep % 2 == 0
        if raw_first:
            raw_put, raw_get, raw_get_load, raw_one = raw_part(rep)
            ours = hicache_part(rep, a, b, c, d)
        else:
            ours = hicache_part(rep, a, b, c, d)
            raw_put, raw_get, raw_get_load, raw_one = raw_part(rep)
        hc_put, put_phases, hc_get, get_phases, after_split, hc_fetch, fetch_phases, added = ours
        gb = n * page / 1e9
        rows.append(
            (
                gb / raw_put,
                gb / hc_put,
                gb / raw_get,
                gb / hc_get,
                added * 1e6,
                gb / hc_fetch,
                raw_one * 1e6,
                gb / raw_get_load,
                (put_phases, get_phases, fetch_phases),
                after_split,
                raw_first,
            )
        )
        ta.calls.clear()
        tb.calls.clear()
    del a, b, c, d
    print(
        f"{n} pages of {args.page_kib} KiB, TCP on loopback, two clients, KV on the {args.device}; "
        f"{args.reps} repetitions"
    )
    print("| | raw client GB/s: median (best) | through hicache GB/s: median (best) | ratio |")
    print("| --- | --- | --- | --- |")

    def row(name: str, raw: int, ours: int) -> None:
        med = statistics.median
        r, o = [x[raw] for x in rows], [x[ours] for x in rows]
        # Each repetition measures both side by side: the median of their ratios leaves out the
        # drift of the link between repetitions.
        each = med(b / a for a, b in zip(r, o, strict=True))
        print(
            f"| {name} | {med(r):.2f} ({max(r):.2f}) | {med(o):.2f} ({max(o):.2f}) | "
            f"{med(o) / med(r):.2f} of the median ({max(o) / max(r):.2f} of the best, "
            f"{each:.2f} the median repetition) |"
        )

    row("put", 0, 1)
    row("get: try_resume, into the engine's blocks", 2, 3)
    row("get: try_resume, against the raw get and a copy into the engine's blocks", 7, 3)
    row("get: prefetch, into host memory", 2, 5)

    def by_order(raw: int, ours: int) -> str:
        med = statistics.median
        return ", ".join(
            f"{what} {med(x[ours] / x[raw] for x in rows if x[10] == first):.2f}"
            for what, first in (("raw client first", True), ("hicache first", False))
            if any(x[10] == first for x in rows)
        )

    print(
        f"the median repetition by order: put {by_order(0, 1)}; try_resume against the raw get and "
        f"a copy {by_order(7, 3)}; prefetch {by_order(2, 5)}"
    )
    print(
        f"added latency of a one-page tier hit over a host hit: {min(r[4] for r in rows):.0f} us "
        f"(median {statistics.median(r[4] for r in rows):.0f}); the raw client's get of one page: "
        f"{min(r[6] for r in rows):.0f} us (median {statistics.median(r[6] for r in rows):.0f})"
    )
    if args.phases:
        print("\n| ms, median | before the first client call | in its calls | between them | after them |")
        print("| --- | --- | --- | --- | --- |")
        for k, name in enumerate(["put", "try_resume", "prefetch"]):
            cols = [statistics.median(r[8][k][j] for r in rows) * 1e3 for j in range(4)]
            print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cols) + " |")
        cols = [statistics.median(r[9][j] for r in rows) * 1e3 for j in range(4)]
        print(
            "\ntry_resume after the last get (ms, medians): to the allocate call "
            f"{cols[0]:.2f}, to its return {cols[1]:.2f}, to the load's end {cols[2]:.2f}; "
            f"a host hit of the same pages: {cols[3]:.2f}"
        )
    ta.close()
    tb.close()


if __name__ == "__main__":
    main()
