"""Where a one-call store of many pages loses time against SlotMover's copy of the same pages,
on the GPU (default options, 1024 pages a call where they fit in 1 GiB):

- ``SlotMover`` alone, the whole batch in one call and in the store's installments (16, 16, 32,
  64... pages) with 0-3 us a page of busy CPU before each (hashing and the index, simulated):
  whether splitting a copy, or CPU work between its parts, costs GPU time;
- the one-call store behind a 3 ms sleep kernel on its stream (its CPU start-up hidden), and
  SlotMover the same way;
- the store's and SlotMover's GPU timeline under ``torch.profiler``: when the first copy
  starts, how long the copies span, and the gaps between them.

    python3 bench/research/store_gap.py
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import hicache

sys.path.insert(0, str(Path(__file__).parent.parent))  # bench/, for layouts.py
import layouts as L  # the grid's layout, cache and timing helpers


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def timeline(fn: Callable[[], Any], wait: Callable[[], None]) -> str:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("CALL"):
            fn()
        wait()
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    ev = json.loads(Path(path).read_text())["traceEvents"]
    Path(path).unlink()
    call = next(e for e in ev if e.get("name") == "CALL" and e.get("ph") == "X")
    gpu = sorted(
        (e for e in ev if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "kernel")),
        key=lambda e: e["ts"],
    )
    if not gpu:
        return "no GPU events"
    end, gaps = gpu[0]["ts"], []
    for e in gpu:
        if e["ts"] > end + 5:
            gaps.append(e["ts"] - end)
        end = max(end, e["ts"] + e["dur"])
    return (
        f"first copy at +{gpu[0]['ts'] - call['ts']:.0f} us, copies span {end - gpu[0]['ts']:.0f} us, "
        f"{len(gaps)} gaps over 5 us ({sum(gaps):.0f} us, the largest {max(gaps, default=0):.0f})"
    )


def measure(chunk: int, nseg: int) -> None:
    pages = min(1024, (1 << 30) // (chunk * nseg))
    p = L.Point(chunk, nseg, pages, "auto")
    mover = hicache._core.SlotMover(p.segs, 2 * pages, "auto", None, False, 1 << 30)
    slots = torch.tensor(random.Random(1).sample(range(2 * pages), pages))
    src = torch.tensor(p.sources)
    one = p.s1.cuda_stream
    bounds = [0, 16]
    while bounds[-1] < pages:
        bounds.append(min(pages, 2 * bounds[-1]))
    cycles = int(3e-3 * 1.98e9)  # ~3 ms at the H200's clock

    def tidy() -> None:
        p.wait()
        mover.finished()

    def whole() -> None:
        mover.submit(True, slots, src, one)

    def parts(us: float) -> Callable[[], None]:
        def run() -> None:
            for lo, hi in itertools.pairwise(bounds):
                spin(us * (hi - lo))
                mover.submit(True, slots[lo:hi], src[lo:hi], one)

        return run

    def store() -> None:
        p.store(p.fresh(), p.s1)

    def sleep() -> None:
        with torch.cuda.stream(p.s1):
            torch.cuda._sleep(cycles)

    out = [f"SlotMover whole {L.best_wall(whole, p.wait, tidy, 5) * 1e3:.2f}"]
    for us in (0, 1, 2, 3):
        out.append(f"in installments +{us} us/page {L.best_wall(parts(us), p.wait, tidy, 5) * 1e3:.2f}")
    out.append(f"one-call store {L.best_wall(store, p.wait, p.sync, 5) * 1e3:.2f}")
    t_sleep = L.best_wall(sleep, p.wait, p.wait, 5)
    behind = L.best_wall(lambda: (sleep(), store()), p.wait, p.sync, 5) - t_sleep
    out.append(f"store behind a {t_sleep * 1e3:.1f} ms sleep {behind * 1e3:.2f}")
    behind = L.best_wall(lambda: (sleep(), whole()), p.wait, tidy, 5) - t_sleep
    out.append(f"SlotMover behind it {behind * 1e3:.2f}")
    print(f"{chunk >> 10} KiB x {nseg} ({p.path}, {pages} pages), ms: " + ", ".join(out), flush=True)
    print(f"  store under the profiler: {timeline(store, p.wait)}", flush=True)
    p.sync()
    print(f"  SlotMover under the profiler: {timeline(whole, p.wait)}", flush=True)
    tidy()


def main() -> None:
    if not torch.cuda.is_available() or not hicache.cuda_available():
        sys.exit("needs a CUDA GPU and a CUDA build of hicache")
    for chunk, nseg in [(512 << 10, 1), (1 << 20, 1), (64 << 10, 32)]:
        measure(chunk, nseg)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
