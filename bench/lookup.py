"""CPU cost of a lookup (try_resume) that misses after the first page, and of one that hits a
128K-token prompt in full, with the null copier (no bytes move): hashing and the index walk.

    python bench/lookup.py      (best of 3 runs of 200 lookups; 50 for the hit)
"""

from __future__ import annotations

import time

import torch

import hicache


def best_us(fn, k: int) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for i in range(k):
            fn(i)
        best = min(best, (time.perf_counter() - t) / k)
    return best * 1e6


def main() -> None:
    seg = torch.zeros(2048, 16, dtype=torch.uint8)
    cache = hicache.HostPrefixCache(seg, block_tokens=128, capacity_pages=2048, copier="null")

    def miss(prompt: torch.Tensor):
        def run(i: int) -> None:
            cache.try_resume(f"m{i}", prompt, lambda n: None)
            cache.forget(f"m{i}")

        return run

    print("| lookup | prompt tokens | us per lookup |")
    print("| --- | --- | --- |")
    for n in (1024, 16 * 1024, 128 * 1024):
        p = torch.randint(0, 50000, (n,), dtype=torch.int32)
        print(f"| miss | {n} | {best_us(miss(p), 200):.1f} |")
    p = torch.randint(0, 50000, (128 * 1024 + 1,), dtype=torch.int32)
    cache.store("s", p, list(range(1025)))
    cache.poll()
    cache.forget("s")

    def hit(i: int) -> None:
        got = cache.try_resume(f"h{i}", p, lambda n: list(range(n // 128)))
        assert got == 128 * 1024, got
        cache.poll()
        cache.forget(f"h{i}")

    print(f"| hit, 1024 pages | {128 * 1024 + 1} | {best_us(hit, 50):.1f} |")


if __name__ == "__main__":
    main()
