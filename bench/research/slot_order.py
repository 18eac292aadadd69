"""What the order of a store's host slots costs its call: slots an eviction freed, run backwards.

A pool of two calls' pages, filled in order: prompt A takes slots 0..n-1, B takes n..2n-1. Each
store after that evicts the oldest chain, leaf first (the default eviction), so its pages take
that chain's slots in reverse: C's and D's run backwards (page i in slot n-1-i), E's and F's
forwards again, and so on. A staging window whose pages' slots follow each other in memory moves
them as one DMA piece, each piece costing the calling thread ~0.4 us (window_calls.cu); slots
that run backwards join only if the window sorts its pages by host address. For the engines'
pools of bench/research/call_profile.py: the median time until a store call returns, per page,
of stores into backwards slots and of stores into forwards slots (and the wall time until their
copies are done), on the default path.

    python3 bench/research/slot_order.py [--stores 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import hicache

sys.path.insert(0, str(Path(__file__).parent))  # bench/research/, for call_profile.py
from call_profile import POOLS  # (model, block tokens, chunk bytes, segments, pages a call)


def measure(model: str, tokens: int, chunk: int, nseg: int, pages: int, stores: int) -> None:
    segs = [torch.randint(0, 255, (pages + 1, chunk), dtype=torch.uint8, device="cuda") for _ in range(nseg)]
    cache = hicache.HostPrefixCache(segs, block_tokens=tokens, capacity_pages=2 * pages, admission="always")
    pool_bytes = 2 * pages * ((chunk * nseg + 255) // 256 * 256)
    t0 = time.perf_counter()
    while cache.stats().host_bytes < pool_bytes:  # every slot pinned before the first store
        if time.perf_counter() - t0 > 60:
            sys.exit(f"the pool was not pinned after 60 s: {cache.stats_dict()}")
        time.sleep(0.01)
    s = torch.cuda.Stream()
    blocks = list(range(pages))
    returned: dict[str, list[float]] = {"backwards": [], "forwards": []}
    done: dict[str, list[float]] = {"backwards": [], "forwards": []}
    for k in range(2 + stores):
        prompt = torch.arange(pages * tokens + 1, dtype=torch.int32) + k * 10_000_000
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = cache.store(f"p{k}", prompt, blocks, stream=s)
        t1 = time.perf_counter()
        s.synchronize()
        t2 = time.perf_counter()
        if got != pages:
            sys.exit(f"stored {got} of {pages} pages: {cache.stats().last_error}")
        cache.poll()
        cache.forget(f"p{k}")
        if k >= 2:  # A and B filled the pool; then two stores backwards, two forwards, ...
            order = "backwards" if (k - 2) // 2 % 2 == 0 else "forwards"
            returned[order].append((t1 - t0) / pages * 1e6)
            done[order].append(t2 - t0)
    mib = chunk * nseg / 2**20
    cells = []
    for order in ("backwards", "forwards"):
        wall = statistics.median(done[order])
        rate = pages * chunk * nseg / wall / 1e9
        cells.append(f"{statistics.median(returned[order]):.2f} ({rate:.1f} GB/s)")
    shape = f"{nseg} x {chunk >> 10} KiB ({mib:.2f} MiB)"
    print(f"| {model} | {shape} | {pages} | {cache.copy_path} | {' | '.join(cells)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stores", type=int, default=24, help="measured stores a pool (half of them backwards)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not hicache.cuda_available():
        sys.exit("needs a CUDA GPU and a CUDA build of hicache")
    gpu = torch.cuda.get_device_name()
    print(f"# store calls into slots an eviction freed; median of {args.stores // 2} each; {gpu}")
    print(
        "| pool | segments x chunk | pages | path "
        "| us a page until the call returns (store rate): slots backwards | forwards |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for pool in POOLS:
        measure(*pool, stores=args.stores)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
