"""What the device's page sums cost a GPU cache's store: its time with and without them.

A GPU cache with a tier has the device sum each page it stores, beside the store's copy, so the
tier thread need not read the page back (docs/tier.md); the store's fence covers the sums. This
times a store (from the call until its stream is done) of fresh pages for the same layout in two
caches side by side: one with a tier (``hicache.MemoryTier``: the sums run) and one without (no
sums), and one contiguous device-to-pinned-host copy of the same bytes. Each repetition runs all
three, in turn; the table gives medians, and the median of each repetition's own with/without
ratio. The tier cache's writes to its tier run after the timed part (``flush_tier``).

    python bench/research/store_sums.py --reps 15
    python bench/research/store_sums.py --device cpu --reps 2   # checks the script (no sums)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import hicache

KIB, MIB = 1 << 10, 1 << 20
B = 16  # tokens a page: only the hash chain sees them
DEVICE = "cuda"
# (name, segments, bytes a segment holds of a page, pages a store)
SHAPES = [
    ("page-major 1 x 8 MiB", 1, 8 * MIB, [1, 4, 32]),
    ("page-major 1 x 1 MiB", 1, MIB, [1, 64, 256]),
    ("MLA 61 x 144 KiB", 61, 144 * KIB, [1, 8, 64]),
    ("Llama-3-8B 64 x 256 KiB", 64, 256 * KIB, [1, 16]),
    ("8B, 16-token blocks: 64 x 32 KiB", 64, 32 * KIB, [1, 16, 1024]),
    ("MLA, 16-token blocks: 61 x 18 KiB", 61, 18 * KIB, [1, 16, 1024]),
    ("70B TP8, 16-token blocks: 160 x 4 KiB", 160, 4 * KIB, [1, 1024]),
]


class Pair:
    """The same layout in two caches: one with a tier (the store's sums run), one without."""

    def __init__(self, nseg: int, chunk: int, pages: int) -> None:
        self.pages, self.page_bytes = pages, nseg * chunk
        self.segs = [torch.empty(pages + 1, chunk, dtype=torch.uint8, device=DEVICE) for _ in range(nseg)]
        for s in self.segs:
            s.random_(0, 255)
        self.tier = hicache.MemoryTier()
        common: dict[str, Any] = {
            "block_tokens": B,
            "capacity_pages": 2 * pages,
            "admission": "always",
            "pin_upfront": True,
        }
        self.plain = hicache.HostPrefixCache(self.segs, **common)
        self.summed = hicache.HostPrefixCache(self.segs, tier=self.tier, **common)
        assert self.plain.copy_path == self.summed.copy_path
        self.path = self.plain.copy_path
        self.stream = torch.cuda.Stream() if DEVICE == "cuda" else None
        self.n = 0
        self.written = 0  # pages the tier cache wrote to its tier
        self.host = torch.empty(pages * self.page_bytes, dtype=torch.uint8)
        if DEVICE == "cuda":
            self.host = self.host.pin_memory()
        self.dev = torch.empty(pages * self.page_bytes, dtype=torch.uint8, device=DEVICE)

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def store(self, cache: hicache.HostPrefixCache) -> float:
        self.n += 1
        prompt = torch.arange(self.pages * B + 1, dtype=torch.int32) + self.n * 10_000_000
        blocks = list(range(1, self.pages + 1))
        self.sync()
        t0 = time.perf_counter()
        got = cache.store(f"s{self.n}", prompt, blocks, stream=self.stream)
        self.sync()
        t = time.perf_counter() - t0
        assert got == self.pages, (got, cache.stats().last_error)
        cache.poll()
        cache.forget(f"s{self.n}")
        if cache is self.summed:
            cache.flush_tier()
            self.written += self.pages
            assert cache.stats().tier_pages_written == self.written, cache.stats().tier_last_error
            for name in self.tier.names():
                self.tier.erase(name)
        return t

    def copy(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        if self.stream is None:
            self.host.copy_(self.dev)
        else:
            with torch.cuda.stream(self.stream):
                self.host.copy_(self.dev, non_blocking=True)
        self.sync()
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"{where}; medians of {args.reps} repetitions, ms")
    print(
        "| layout | pages | path | contiguous copy | store, no tier | store, tier (device sums) "
        "| with / without: medians (median repetition) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, nseg, chunk, page_counts in SHAPES:
        for pages in page_counts:
            p = Pair(nseg, chunk, pages)
            for _ in range(2):  # warm: the first stores pay for first touches
                p.store(p.plain)
                p.store(p.summed)
                p.copy()
            rows = []
            for rep in range(args.reps):
                order = [p.plain, p.summed] if rep % 2 == 0 else [p.summed, p.plain]
                t = {id(c): p.store(c) for c in order}
                rows.append((p.copy(), t[id(p.plain)], t[id(p.summed)]))
            med = [statistics.median(r[j] for r in rows) for j in range(3)]
            each = statistics.median(r[2] / r[1] for r in rows)
            print(
                f"| {name} | {pages} | {p.path} | {med[0] * 1e3:.3f} | {med[1] * 1e3:.3f} | "
                f"{med[2] * 1e3:.3f} | {med[2] / med[1]:.2f} ({each:.2f}) |",
                flush=True,
            )
            del p
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
