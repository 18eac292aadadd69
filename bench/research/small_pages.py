"""Where the time of a call of many small pages goes: hashing, the rest of the CPU work, the copy.

For a few layouts of small pages (1024 pages a call by default) on the GPU: how long a store and
a load take to return (the CPU work before and while enqueueing) and to complete, the same store
with ``copier="null"`` (the CPU work without any copy), ``hicache.chain_keys`` of the prompt
alone, and one contiguous copy of the same bytes. Best of 5 each; default options otherwise.

    python3 bench/research/small_pages.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import hicache

sys.path.insert(0, str(Path(__file__).parent.parent))  # bench/, for layouts.py
import layouts as L  # the grid's layout, cache and timing helpers

LAYOUTS = [  # (chunk bytes, segments, pages a call, cuda_path)
    (16 << 10, 1, 1024, "auto"),
    (64 << 10, 1, 1024, "auto"),
    (128 << 10, 2, 1024, "auto"),
    (512 << 10, 1, 1024, "auto"),
    (16 << 10, 64, 512, "auto"),
    (128 << 10, 64, 64, "auto"),
    (16 << 10, 1, 1024, "dma"),
    (128 << 10, 1, 1024, "dma"),
]


def no_wait() -> None:
    pass


def measure(chunk: int, nseg: int, pages: int, path: str) -> tuple[str, list[float]]:
    """The copy path and, in seconds: contiguous copy, store returns / done, load returns / done,
    null-copier store, chain_keys."""
    p = L.Point(chunk, nseg, pages, path)
    returned: list[float] = []

    def store() -> None:
        prompt = p.fresh()
        t0 = time.perf_counter()
        p.store(prompt, p.s1)
        returned.append(time.perf_counter() - t0)
        p.wait()

    def load() -> None:
        t0 = time.perf_counter()
        p.load(p.s1)
        returned.append(time.perf_counter() - t0)
        p.wait()

    store_done = L.best_wall(store, p.wait, p.sync, 5)
    store_ret = min(returned)
    returned.clear()
    load_done = L.best_wall(load, p.wait, p.sync, 5)
    load_ret = min(returned)
    nbytes = pages * chunk * nseg
    pinned = L.host_buffer(nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def h2d() -> None:
        with L.on(p.s1):
            dev.copy_(pinned, non_blocking=True)
        p.s1.synchronize()

    contiguous = L.best_wall(h2d, no_wait, no_wait, 5)
    prompt = p.prompt()
    hashing = L.best_wall(lambda: hicache.chain_keys(prompt, L.B), no_wait, no_wait, 5)
    null = hicache.HostPrefixCache(
        p.segs, block_tokens=L.B, capacity_pages=4 * pages, copier="null", admission="always"
    )
    n = [0]
    prompts = [p.prompt() for _ in range(5)]  # made before the timed calls

    def null_store() -> None:
        n[0] += 1
        null.store(f"x{n[0]}", prompts[n[0] - 1], p.sources)

    null_s = L.best_wall(null_store, no_wait, no_wait, 5)
    return p.path, [contiguous, store_ret, store_done, load_ret, load_done, null_s, hashing]


def main() -> None:
    if not torch.cuda.is_available() or not hicache.cuda_available():
        sys.exit("needs a CUDA GPU and a CUDA build of hicache")
    print(
        "| layout | pages | path | contiguous | store returns | store done | load returns | load done "
        "| null-copier store | chain_keys |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for chunk, nseg, pages, path in LAYOUTS:
        chosen, times = measure(chunk, nseg, pages, path)
        cells = " | ".join(f"{t * 1e3:.3f} ms" for t in times)
        print(f"| {chunk >> 10} KiB x {nseg} | {pages} | {chosen} | {cells} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
