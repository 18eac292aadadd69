"""Where a store and a load at once lose time against two contiguous copies at once.

For layouts whose one-call API is below 0.90 both at once while its copy half (`SlotMover`) is
not (`bench/layouts.py` grid), one run that takes the both-at-once case apart: when each call
returns, when each direction's copies end on the GPU (CUDA events on its stream, from an event
recorded on it just before the calls), the same with the load called first, the two calls from
two threads, and the copy half alone both at once. Times in ms from the first call, the median
of reps.

    python3 bench/research/both_at_once.py [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import hicache

sys.path.insert(0, str(Path(__file__).parent.parent))  # bench/, for layouts.py
import layouts as L  # the grid's layout, cache and timing helpers

KIB = 1024
POINTS = [  # (chunk bytes, segments, pages a call, block tokens)
    (16 * KIB, 32, 1024, L.B),
    (16 * KIB, 64, 1024, L.B),
    (32 * KIB, 32, 1024, L.B),
    (32 * KIB, 64, 512, 16),  # Llama-3-8B's pool at 16-token blocks
    (256 * KIB, 1, 1024, L.B),  # the DMA path
    (512 * KIB, 2, 1024, L.B),
    (1024 * KIB, 1, 1024, L.B),  # 1 GiB a call each way
]


class Timeline:
    """Each direction's end on the GPU, from a start event recorded on its stream."""

    def __init__(self, s1: torch.cuda.Stream, s2: torch.cuda.Stream) -> None:
        self.s1, self.s2 = s1, s2

    def run(self, calls: Callable[[], list[float]]) -> dict[str, float]:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record(self.s1)
        ev[1].record(self.s2)
        t0 = time.perf_counter()
        returned = calls()
        ev[2].record(self.s1)
        ev[3].record(self.s2)
        ev[2].synchronize()
        ev[3].synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        out = {"s1_end": ev[0].elapsed_time(ev[2]), "s2_end": ev[1].elapsed_time(ev[3]), "wall": wall}
        for i, r in enumerate(returned):
            out[f"ret{i}"] = (r - t0) * 1e3
        return out


def median(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each time's median over the runs (a run's calls return at times that vary more than its
    copies end: the best run by wall time says little about its calls)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def probe(chunk: int, nseg: int, pages: int, tokens: int, reps: int, trace_dir: Path | None = None) -> None:
    p = L.Point(chunk, nseg, pages, "auto", tokens=tokens)
    tl = Timeline(p.s1, p.s2)
    nbytes = pages * p.page_bytes
    pinned, pinned2 = L.host_buffer(nbytes), L.host_buffer(nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def contiguous() -> list[float]:
        with torch.cuda.stream(p.s1):
            pinned2.copy_(dev2, non_blocking=True)  # "store" on s1
        a = time.perf_counter()
        with torch.cuda.stream(p.s2):
            dev.copy_(pinned, non_blocking=True)  # "load" on s2
        return [a, time.perf_counter()]

    def store_then_load() -> list[float]:
        p.store(p.fresh(), p.s1)
        a = time.perf_counter()
        p.load(p.s2)
        return [a, time.perf_counter()]

    def load_then_store() -> list[float]:
        prompt = p.fresh()
        p.load(p.s2)
        a = time.perf_counter()
        p.store(prompt, p.s1)
        return [a, time.perf_counter()]

    # Two threads that live as long as the point, as an engine's do (a thread made per run pays
    # the setup of its first CUDA and torch calls in every run; bench/research/two_threads.py's
    # are long-lived too).
    workers = ThreadPoolExecutor(max_workers=2)

    def threads() -> list[float]:
        prompt = p.fresh()
        at: list[float] = [0.0, 0.0]
        go = threading.Barrier(2)

        def one(i: int, fn: Callable[[], None]) -> None:
            go.wait()
            fn()
            at[i] = time.perf_counter()

        calls = [
            workers.submit(one, 0, lambda: p.store(prompt, p.s1)),
            workers.submit(one, 1, lambda: p.load(p.s2)),
        ]
        for c in calls:
            c.result()
        return at

    def store_alone() -> list[float]:
        p.store(p.fresh(), p.s1)
        return [time.perf_counter()]

    def load_alone() -> list[float]:
        p.load(p.s2)
        return [time.perf_counter()]

    nslots = 2 * pages
    # Made at its case, the last: its pool is pinned in the background, and pinning takes the
    # driver's lock from the calls measured beside it.
    mover: list[Any] = []
    slots, others = torch.arange(pages), torch.arange(pages, nslots)
    src, dst = torch.tensor(p.sources), torch.tensor(p.targets)

    def mover_both() -> list[float]:
        if not mover:
            mover.append(hicache._core.SlotMover(p.segs, nslots, "auto", None, False, 1 << 30))
            time.sleep(1.0)  # 1 GiB pins in ~0.1 s
        m = mover[0]
        m.submit(True, slots, src, p.s1.cuda_stream)
        a = time.perf_counter()
        m.submit(False, others, dst, p.s2.cuda_stream)
        return [a, time.perf_counter()]

    cases = {
        "two contiguous copies": contiguous,
        "store, then load": store_then_load,
        "load, then store": load_then_store,
        "two threads": threads,
        "store alone": store_alone,
        "load alone": load_alone,
        "SlotMover store, then load": mover_both,
    }
    mib = p.page_bytes / 2**20
    print(f"\n### {nseg} x {chunk // KIB} KiB ({mib:.2f} MiB), {pages} pages, {tokens}-token blocks,", p.path)
    print("\n| case | first call returns | second returns | s1 (store) ends | s2 (load) ends | wall |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, fn in cases.items():
        runs = []
        for _ in range(reps):
            p.sync()
            if mover:
                mover[0].finished()
            runs.append(tl.run(fn))
        r = median(runs)
        print(
            f"| {name} | {r['ret0']:.2f} | {r.get('ret1', float('nan')):.2f} | {r['s1_end']:.2f} | "
            f"{r['s2_end']:.2f} | {r['wall']:.2f} |"
        )
    workers.shutdown()
    p.sync()
    if trace_dir is not None:  # one run of each case under torch's profiler, as Chrome traces
        from torch.profiler import ProfilerActivity, profile

        for name in ("store, then load", "store alone", "load alone"):
            p.sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                tl.run(cases[name])
            tag = name.replace(", ", "-").replace(" ", "-")
            prof.export_chrome_trace(str(trace_dir / f"{nseg}x{chunk // KIB}k-{pages}-{tag}.json"))
        p.sync()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--trace", type=Path, help="also write Chrome traces of the first point run's cases here")
    ap.add_argument("--points", type=int, default=len(POINTS), help="only the first N points")
    ap.add_argument("--skip", type=int, default=0, help="skip the first N points")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not hicache.cuda_available():
        sys.exit("needs a CUDA GPU and a CUDA build of hicache")
    for i, point in enumerate(POINTS[args.skip : args.points]):
        probe(*point, reps=args.reps, trace_dir=args.trace if i == 0 else None)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
