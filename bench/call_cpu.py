"""The CPU work of a 1024-page call, without any copy (the null copier): hashing the prompt
(``hicache.chain_keys``), a lookup whose every page is cached, and stores of a new prompt (into
free slots, and into a full pool, evicting as many pages) and of a cached one. Best of N. Runs
on any machine (no GPU needed).

    python3 bench/call_cpu.py [--pages 1024] [--reps 15] [--block-tokens 128] [--pool-pages N]

Last, the store of a new prompt into a pool of ``--pool-pages`` one-page prompts stored in
random order (the layout grid's pool: every page evicts one whose entry, index slots and token
buffer no recent call touched), default options, median and best of the repetitions.

Calls of a few pages take tens of microseconds: give them more repetitions (``--pages 16 --reps
200``) on a machine with other work on it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import hicache


def best(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=15, help="calls of each kind, the best counts")
    ap.add_argument("--block-tokens", type=int, default=128, help="tokens a page (engines use 16-64)")
    ap.add_argument("--pool-pages", type=int, default=65536, help="slots of the pool of one-page prompts")
    args = ap.parse_args()
    pages, reps, B = args.pages, args.reps, args.block_tokens
    prompt = torch.arange(pages * B + 1, dtype=torch.int32) + 77
    segs = [torch.empty(2 * pages + 1, 256, dtype=torch.uint8)]
    cache = hicache.HostPrefixCache(
        segs, block_tokens=B, capacity_pages=(reps + 2) * pages, copier="null", admission="always"
    )
    blocks = list(range(pages))
    cache.store("a", prompt, blocks)
    cache.poll()

    def lookup() -> None:
        cache.try_resume("r", prompt, lambda n: blocks[: n // B])
        cache.poll()
        cache.forget("r")

    # New prompts made before the timed calls (making one is a few microseconds of torch).
    fresh = iter([prompt + (i + 1) * 10_000_000 for i in range(3 * reps)])
    n = [0]

    def store_new() -> None:
        n[0] += 1
        cache.store(f"s{n[0]}", next(fresh), blocks)

    print(f"{pages} pages of {B} tokens, best of {reps}, ms:")
    print(f"chain_keys {best(lambda: hicache.chain_keys(prompt, B), reps):.3f}")
    print(f"lookup, all cached {best(lookup, reps):.3f}")
    print(f"store, new prompt {best(store_new, reps):.3f}")
    print(f"store, cached prompt {best(lambda: cache.store('a', prompt, blocks), reps):.3f}")

    full = hicache.HostPrefixCache(
        segs, block_tokens=B, capacity_pages=4 * pages, copier="null", admission="always"
    )
    for i in range(4):  # fill the pool with other prompts: every later page evicts one
        full.store(f"f{i}", prompt - (i + 1) * 10_000_000, blocks)
    full.poll()

    def store_full() -> None:
        n[0] += 1
        full.store(f"s{n[0]}", next(fresh), blocks)
        full.poll()

    print(f"store, new prompt, pool full {best(store_full, reps):.3f}")

    pool = max(args.pool_pages, pages)
    scattered = hicache.HostPrefixCache(segs, block_tokens=B, capacity_pages=pool, copier="null")
    one_page = torch.randperm(pool, generator=torch.Generator().manual_seed(1))
    for k in one_page.tolist():
        scattered.store("f", torch.arange(B, dtype=torch.int32) + 1_000_000_000 + k * B, [0])
    scattered.poll()
    times = []
    for _ in range(reps):
        n[0] += 1
        t0 = time.perf_counter()
        scattered.store(f"s{n[0]}", next(fresh), blocks)
        times.append(time.perf_counter() - t0)
        scattered.poll()
    assert scattered.stats().pages_evicted >= reps * pages, "the stores did not evict"
    times.sort()
    print(
        f"store, new prompt, pool of {pool} one-page prompts in random order: "
        f"median {times[len(times) // 2] * 1e3:.3f}, best {times[0] * 1e3:.3f}"
    )


if __name__ == "__main__":
    main()
