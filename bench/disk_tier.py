"""The disk tier's speed through the public API, beside a raw loop over the same directory.

    python bench/disk_tier.py --dir /path/on/the/disk [--page-mib 1] [--total-mib 1024] [--reps 3]
        [--index-pages 1000000] [--read-threads 8]

In one run, on one directory:
- raw: a sequential write, then read, of the same bytes in 64 MiB calls (O_DIRECT where the
  filesystem takes it, as the tier does);
- write: a HostPrefixCache (CPU KV) over a DiskTier stores one prompt of those bytes and
  flush_tier() waits until every page is on disk (store to flush, and the flush alone);
- read: a new cache (empty host memory, the engine restarted) over the same DiskTier resumes the
  prompt, waiting for the disk: every page read, its record and checksum checked, and loaded
  into the engine's blocks;
- a one-page hit from the disk beside one from host memory (medians);
- the index of a directory of --index-pages values rebuilt at opening, from the segments' index
  files, and by scanning the segments when those are gone.
Ratios are the raw loop's time over the API's (>= 0.9 is the target). Best of --reps.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

import hicache

CHUNK = 64 << 20


def raw_loop(path: Path, total: int) -> tuple[float, float, bool]:
    """Seconds to write, then read, `total` bytes sequentially; and whether O_DIRECT was used."""
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (CHUNK >> 20))
    direct = True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        direct = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, total, CHUNK):
            os.pwrite(fd, buf, off)
        if not direct:
            os.fsync(fd)
        w = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, total, CHUNK):
            os.preadv(fd, [buf], off)
        r = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return w, r, direct


def api_round(where: Path, page: int, pages: int, tokens: int, read_threads: int) -> dict[str, float]:
    shutil.rmtree(where, ignore_errors=True)
    kv = np.random.default_rng(1).integers(0, 256, (pages, page), dtype=np.uint8)
    prompt = np.arange(pages * tokens + 1, dtype=np.int32)
    tier = hicache.DiskTier(where, 4 * pages * page + (256 << 20), read_threads=read_threads)
    a = hicache.HostPrefixCache(kv, block_tokens=tokens, capacity_pages=pages, tier=tier)
    t0 = time.perf_counter()
    assert a.store("w", prompt, list(range(pages))) == pages
    t1 = time.perf_counter()
    a.flush_tier()
    t2 = time.perf_counter()
    assert a.stats().tier_pages_written == pages, a.stats().tier_last_error
    del a
    # The engine restarted: empty host memory. prefetch() reads the prompt's pages from the disk
    # into host memory (each checked against its record) off the engine's thread; try_resume
    # then loads them into the engine's blocks.
    engine = np.zeros_like(kv)
    b = hicache.HostPrefixCache(engine, block_tokens=tokens, capacity_pages=pages, tier=tier, tier_wait_ms=0)
    t3 = time.perf_counter()
    assert b.prefetch(prompt) == pages
    while b.stats().tier_pages_fetched < pages:
        time.sleep(0.0002)
    t4 = time.perf_counter()
    got = b.try_resume("r", prompt, lambda n: list(range(n // tokens)))
    t5 = time.perf_counter()
    assert got == pages * tokens and np.array_equal(engine, kv), (got, b.stats().tier_last_error)
    del b
    # And without prefetch: a try_resume that waits for the disk, all in one call.
    engine[:] = 0
    c = hicache.HostPrefixCache(
        engine, block_tokens=tokens, capacity_pages=pages, tier=tier, tier_wait_ms=600_000
    )
    t6 = time.perf_counter()
    got = c.try_resume("r", prompt, lambda n: list(range(n // tokens)))
    t7 = time.perf_counter()
    assert got == pages * tokens and np.array_equal(engine, kv), (got, c.stats().tier_last_error)
    s = tier.stats()
    return {
        "straight": (s["values_written_direct"] + s["values_read_direct"])
        / max(1, s["values_written"] + s["values_read"]),
        "store_to_flush": t2 - t0,
        "flush": t2 - t1,
        "prefetch": t4 - t3,
        "load": t5 - t4,
        "read": t7 - t6,
    }


def one_page_latency(where: Path, page: int, tokens: int, n: int = 40) -> tuple[float, float]:
    shutil.rmtree(where, ignore_errors=True)
    tier = hicache.DiskTier(where, 4 * n * page + (64 << 20))
    kv = np.random.default_rng(2).integers(0, 256, (1, page), dtype=np.uint8)
    writer = hicache.HostPrefixCache(kv, block_tokens=tokens, capacity_pages=n, tier=tier)
    prompts = [np.arange(tokens + 1, dtype=np.int32) + i * 1_000_000 for i in range(n)]
    for i, p in enumerate(prompts):
        writer.store(str(i), p, [0])
    writer.flush_tier()
    del writer
    disk, host = [], []
    for i, p in enumerate(prompts):
        engine = np.zeros((1, page), np.uint8)
        c = hicache.HostPrefixCache(
            engine, block_tokens=tokens, capacity_pages=1, tier=tier, tier_wait_ms=60_000
        )
        t0 = time.perf_counter()
        assert c.try_resume(f"d{i}", p, lambda k: [0]) == tokens
        disk.append(time.perf_counter() - t0)
        c.poll()
        t0 = time.perf_counter()
        assert c.try_resume(f"h{i}", p, lambda k: [0]) == tokens
        host.append(time.perf_counter() - t0)
    return statistics.median(disk), statistics.median(host)


def index_rebuild(where: Path, n: int) -> dict[str, float]:
    shutil.rmtree(where, ignore_errors=True)
    value = np.random.default_rng(3).integers(0, 256, 256, dtype=np.uint8)
    cap = n * 4096 + (1 << 30)
    tier = hicache.DiskTier(where, cap)
    t0 = time.perf_counter()
    step = 8192
    for first in range(0, n, step):
        names = [f"hicache/bench/{i:016x}" for i in range(first, min(n, first + step))]
        b = tier.put(names, [value.ctypes.data] * len(names), [value.nbytes] * len(names))
        while (r := tier.poll(b)) is None:
            tier.wait(b, 10)
        assert min(r) == value.nbytes
    written = time.perf_counter() - t0
    del tier  # closes: the last segment gets its index file
    tier = hicache.DiskTier(where, cap)
    s = tier.stats()
    assert s["values"] == n
    with_index = s["index_rebuild_s"]
    del tier
    for idx in where.glob("*.idx"):
        idx.unlink()
    tier = hicache.DiskTier(where, cap)
    s = tier.stats()
    assert s["values"] == n and s["segments_scanned"] > 0
    scanned = s["index_rebuild_s"]
    del tier
    shutil.rmtree(where, ignore_errors=True)
    return {"written": written, "with_index": with_index, "scanned": scanned}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure (made and removed)")
    ap.add_argument("--page-mib", type=float, default=1.0, help="bytes of one page, in MiB")
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes written and read, in MiB")
    ap.add_argument("--tokens", type=int, default=128, help="tokens a page")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--read-threads", type=int, default=8, help="DiskTier's read_threads")
    ap.add_argument(
        "--index-pages", type=int, default=1_000_000, help="values for the index rebuild (0: skip)"
    )
    args = ap.parse_args()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    page = int(args.page_mib * (1 << 20))
    total = args.total_mib << 20
    pages = total // page
    total = pages * page
    best: dict[str, float] = {}
    direct = True
    straight = 0.0
    for _ in range(args.reps):
        w, r, direct = raw_loop(base / "raw.bin", (total + CHUNK - 1) // CHUNK * CHUNK)
        best["raw_write"] = min(
            best.get("raw_write", 1e9), w * total / ((total + CHUNK - 1) // CHUNK * CHUNK)
        )
        best["raw_read"] = min(best.get("raw_read", 1e9), r * total / ((total + CHUNK - 1) // CHUNK * CHUNK))
        api = api_round(base / "tier", page, pages, args.tokens, args.read_threads)
        for k in ("store_to_flush", "flush", "prefetch", "load", "read"):
            best[k] = min(best.get(k, 1e9), api[k])
        straight = api["straight"]
    gb = total / 1e9
    print(
        f"directory {base} ({'direct I/O' if direct else 'buffered'}), {pages} pages of {page >> 10} KiB "
        f"({total >> 20} MiB), {args.read_threads} read threads, best of {args.reps}; "
        f"{straight:.0%} of the values written and read moved straight between a host slot and "
        "the disk\n"
    )
    print("| what | seconds | GB/s | raw loop / API |\n| --- | --- | --- | --- |")
    print(f"| raw sequential write | {best['raw_write']:.3f} | {gb / best['raw_write']:.2f} | |")
    print(f"| raw sequential read | {best['raw_read']:.3f} | {gb / best['raw_read']:.2f} | |")
    print(
        f"| store + flush_tier (host copy, then disk) | {best['store_to_flush']:.3f} | "
        f"{gb / best['store_to_flush']:.2f} | {best['raw_write'] / best['store_to_flush']:.3f} |"
    )
    print(
        f"| flush_tier alone (the disk write) | {best['flush']:.3f} | {gb / best['flush']:.2f} | "
        f"{best['raw_write'] / best['flush']:.3f} |"
    )
    print(
        f"| prefetch: disk to host memory, every page checked | {best['prefetch']:.3f} | "
        f"{gb / best['prefetch']:.2f} | {best['raw_read'] / best['prefetch']:.3f} |"
    )
    print(f"| then try_resume: host memory to the engine | {best['load']:.3f} | {gb / best['load']:.2f} | |")
    print(
        f"| try_resume waiting for the disk (both in one call) | {best['read']:.3f} | "
        f"{gb / best['read']:.2f} | {best['raw_read'] / best['read']:.3f} |"
    )
    disk, host = one_page_latency(base / "latency", page, args.tokens)
    print(
        f"\none {page >> 10} KiB page: a hit from the disk {disk * 1e3:.3f} ms, from host memory "
        f"{host * 1e3:.3f} ms (medians of 40)"
    )
    if args.index_pages:
        ix = index_rebuild(base / "index", args.index_pages)
        print(
            f"\nindex of {args.index_pages:,} values (4 KiB entries, "
            f"{args.index_pages * 4096 / 1e9:.1f} GB): "
            f"written in {ix['written']:.1f} s; rebuilt at opening in {ix['with_index']:.2f} s from the "
            f"segments' index files, {ix['scanned']:.2f} s by scanning the segments"
        )


if __name__ == "__main__":
    main()
