"""How long a store call holds the engine's thread, and a store then a load issued after it, on
the grid's shuffled pool.

For a few layouts (the DMA path's page-major pages, engines' staged pools of 16-token blocks, and
the kernel path), ~1000 pages a call: the store call's time until it returns (median and best of
--reps), and a store on one stream then a load on another, from this thread, against two
contiguous copies of the same bytes at once (median of --reps pairs, each pair's own ratio). Made
to compare two builds side by side (`scripts/gpu_run.sh ab`): a store whose copies were enqueued
from a thread of their own against one that enqueues them itself (docs/performance.md, "A store
and a load at once, from one thread").

    python3 bench/research/store_behind.py [--reps 21] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import hicache

sys.path.insert(0, str(Path(__file__).parent.parent))  # bench/, for layouts.py
import layouts as L  # the grid's layout, cache and timing helpers

KIB = 1024
LAYOUTS = [  # (name, block tokens, chunk bytes, segments, pages a call)
    ("page-major 1 x 256 KiB", 128, 256 * KIB, 1, 1024),
    ("page-major 1 x 1 MiB", 128, 1024 * KIB, 1, 1024),
    ("Llama-3-70B TP8, 160 x 4 KiB", 16, 4 * KIB, 160, 1024),
    ("DeepSeek-V3 MLA, 61 x 18 KiB", 16, 18 * KIB, 61, 954),
    ("kernel (control), 1 x 16 KiB", 128, 16 * KIB, 1, 1024),
]


def measure(name: str, tokens: int, chunk: int, nseg: int, pages: int, reps: int) -> None:
    p = L.Point(chunk, nseg, pages, "auto", capacity=2, tokens=tokens)
    nbytes = pages * chunk * nseg
    pinned = L.host_buffer(nbytes)
    pinned2 = L.host_buffer(nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=L.DEVICE)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=L.DEVICE)
    calls, pairs = [], []
    for _ in range(2):  # warm: the buffers' first copies, the cache's first calls
        with L.on(p.s1):
            dev.copy_(pinned, non_blocking=True)
        with L.on(p.s2):
            pinned2.copy_(dev2, non_blocking=True)
        p.sync()
        p.store(p.fresh(), p.s1)
        p.load(p.s2)
        p.sync()
    for _ in range(reps):
        p.sync()
        prompt = p.fresh()
        t0 = time.perf_counter()
        p.store(prompt, p.s1)
        calls.append(time.perf_counter() - t0)
        p.sync()
        t0 = time.perf_counter()
        with L.on(p.s1):
            dev.copy_(pinned, non_blocking=True)
        with L.on(p.s2):
            pinned2.copy_(dev2, non_blocking=True)
        p.wait()
        both = time.perf_counter() - t0
        p.sync()
        prompt = p.fresh()
        t0 = time.perf_counter()
        p.store(prompt, p.s1)
        p.load(p.s2)
        p.wait()
        pairs.append(both / (time.perf_counter() - t0))
    p.sync()
    us = [c / pages * 1e6 for c in calls]
    print(
        f"| {name} | {p.path} | {pages} | {statistics.median(us):.2f} / {min(us):.2f} "
        f"| {statistics.median(pairs):.3f} ({min(pairs):.3f}-{max(pairs):.3f}) |",
        flush=True,
    )
    del p
    if L.DEVICE == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: to check the script")
    args = ap.parse_args()
    L.DEVICE = args.device
    if L.DEVICE == "cuda" and (not torch.cuda.is_available() or not hicache.cuda_available()):
        sys.exit("needs a CUDA GPU and a CUDA build of hicache (or --device cpu)")
    where = torch.cuda.get_device_name() if L.DEVICE == "cuda" else "CPU"
    print(f"# {where}, {args.reps} repetitions; shuffled slots and blocks")
    print(
        "| layout | path | pages | store call, us a page: median / best "
        "| store then load against two copies at once: median (range) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for layout in LAYOUTS:
        measure(*layout, reps=args.reps)


if __name__ == "__main__":
    main()
