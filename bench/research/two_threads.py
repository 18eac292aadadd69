"""A store and a load of one cache called from two threads at once, as an engine with a load
thread and a write thread calls them (SGLang's cache controller has one of each).

For each point, a cache with default options over the layout grid's pool (``bench/layouts.py``):
each call alone, the two calls one after the other on one thread, and the two calls from two
threads released together. Per case, the median over ``--reps`` runs of how long each call took
from its start until it returned, and when the load returned and both directions' copies were
done, counted from the start of the first call.
Every public method of the cache may be called from several threads, but a call holds the
cache's lock while it enqueues its copies (and, on the CPU copier, while it copies), so a load
called beside a store waits for the store's copies to be enqueued before it starts its own.

    python3 bench/research/two_threads.py [--device cuda|cpu] [--reps 9]

``--device cpu`` runs on the CPU copier over host-memory segments (any machine): there the copy
itself runs inside the call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

import hicache

sys.path.insert(0, str(Path(__file__).parent.parent))  # bench/, for layouts.py
import layouts as L  # the grid's layout, cache and timing helpers

KIB = 1024
POINTS = {  # device: [(chunk bytes, segments, pages a call)]
    "cuda": [(256 * KIB, 1, 1024), (64 * KIB, 1, 1024), (16 * KIB, 32, 1024), (32 * KIB, 64, 512)],
    "cpu": [(256 * KIB, 1, 256), (16 * KIB, 32, 128)],
}


def probe(chunk: int, nseg: int, pages: int, reps: int) -> None:
    p = L.Point(chunk, nseg, pages, "auto")

    def timed(fn: Callable[[], None], times: dict[str, float], name: str) -> None:
        times[name + "0"] = time.perf_counter()
        fn()
        times[name + "1"] = time.perf_counter()

    def store(times: dict[str, float], prompt: torch.Tensor) -> None:
        timed(lambda: p.store(prompt, p.s1), times, "s")

    def load(times: dict[str, float]) -> None:
        timed(lambda: p.load(p.s2), times, "l")

    def store_alone(times: dict[str, float], prompt: torch.Tensor) -> None:
        store(times, prompt)

    def load_alone(times: dict[str, float], prompt: torch.Tensor) -> None:
        load(times)

    def one_thread(times: dict[str, float], prompt: torch.Tensor) -> None:
        store(times, prompt)
        load(times)

    def two_threads(times: dict[str, float], prompt: torch.Tensor) -> None:
        go = threading.Barrier(2)

        def after(fn: Callable[[], None]) -> None:
            go.wait()
            fn()

        ts = [
            threading.Thread(target=after, args=(lambda: store(times, prompt),)),
            threading.Thread(target=after, args=(lambda: load(times),)),
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    cases = {
        "store alone": store_alone,
        "load alone": load_alone,
        "store, then load, one thread": one_thread,
        "store and load, two threads": two_threads,
    }
    print(
        f"\n### {nseg} x {chunk // KIB} KiB ({p.page_bytes / 2**20:.2f} MiB pages), {pages} pages, {p.path}"
    )
    print("\n| case | store call (ms) | load call (ms) | the load returns (ms) | both directions done (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for name, case in cases.items():
        runs: list[dict[str, float]] = []
        for _ in range(reps):
            p.sync()
            prompt = p.fresh()
            times: dict[str, float] = {}
            case(times, prompt)
            p.wait()
            times["done"] = time.perf_counter()
            start = min(v for k, v in times.items() if k.endswith("0"))
            runs.append(
                {
                    "store": (times["s1"] - times["s0"]) * 1e3 if "s0" in times else float("nan"),
                    "load": (times["l1"] - times["l0"]) * 1e3 if "l0" in times else float("nan"),
                    "load_returns": (times["l1"] - start) * 1e3 if "l0" in times else float("nan"),
                    "done": (times["done"] - start) * 1e3,
                }
            )
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {name} | {m['store']:.2f} | {m['load']:.2f} | {m['load_returns']:.2f} | {m['done']:.2f} |",
            flush=True,
        )
    p.sync()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    if args.device == "cuda" and (not torch.cuda.is_available() or not hicache.cuda_available()):
        sys.exit("--device cuda needs a CUDA GPU and a CUDA build of hicache (or pass --device cpu)")
    L.DEVICE = args.device
    for point in POINTS[args.device]:
        probe(*point, reps=args.reps)
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
