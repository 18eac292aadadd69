"""The vLLM worker's copies on a GPU: hicache's SlotMover over vLLM-shaped KV views.

vLLM hands an offloading worker one int8 ``(num_blocks, page_bytes)`` view per layer. This
builds such views on the GPU for several model shapes, stores and loads batches of blocks
through ``SlotMover`` (the copier half ``hicache.vllm`` uses) and compares each with one
contiguous torch copy of the same bytes between the GPU and pinned host memory, measured in the
same run. It also checks every byte of a round trip, with private and with shared host memory.

    python bench/vllm_worker.py [--blocks 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from hicache import _core

SHAPES = {  # name: (layers, bytes per layer per 128-token block)
    "llama3-8b (32 x 512 KiB)": (32, 2 * 128 * 8 * 128 * 2),
    "deepseek MLA (61 x 144 KiB)": (61, 128 * 576 * 2),
    "70B over TP=8 (80 x 64 KiB)": (80, 2 * 128 * 1 * 128 * 2),
}


def timed(fn: Callable[[], object], reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(views: list[torch.Tensor], n: int, shared: bool) -> dict[str, object]:
    """Stores blocks 0..n-1 into slots, loads them into blocks n..2n-1; rates against torch."""
    layers, page = len(views), int(views[0].shape[1])
    slots = 2 * n
    shm = f"hicache-bench-{os.getpid()}" if shared else None
    mover = _core.SlotMover(views, slots, "auto", shm, True, slots * layers * page)
    stream = torch.cuda.current_stream().cuda_stream
    src = np.arange(n, dtype=np.int64)
    dst = np.arange(n, 2 * n, dtype=np.int64)
    slot_ids = np.arange(n, dtype=np.int64)
    t_store = timed(lambda: mover.wait([mover.submit(True, slot_ids, src, stream)]))
    t_load = timed(lambda: mover.wait([mover.submit(False, slot_ids, dst, stream)]))
    mover.finished()
    exact = all(torch.equal(v[n : 2 * n], v[:n]) for v in views)  # the loads brought back the stores
    nbytes = n * layers * page
    host = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.int8, device=views[0].device)
    t_d2h = timed(lambda: host.copy_(gpu, non_blocking=True))
    t_h2d = timed(lambda: gpu.copy_(host, non_blocking=True))
    return {
        "memory": "shared (/dev/shm, registered)" if shared else "private (pinned)",
        "path": mover.copy_path,
        "blocks": n,
        "MiB": round(nbytes / 2**20),
        "store_GBps": round(nbytes / t_store / 1e9, 1),
        "load_GBps": round(nbytes / t_load / 1e9, 1),
        "store_ratio": round(t_d2h / t_store, 3),
        "load_ratio": round(t_h2d / t_load, 3),
        "exact": exact,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=128, help="blocks a job moves")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n = args.blocks
    rows = []
    for name, (layers, page) in SHAPES.items():
        shape = (2 * n + 8, page)
        views = [torch.randint(-128, 127, shape, dtype=torch.int8, device="cuda") for _ in range(layers)]
        for shared in (False, True):
            r = {"shape": name, **measure(views, n, shared)}
            rows.append(r)
            if not args.json:
                print(
                    f"| {r['shape']} | {r['memory']} | {r['path']} | {r['MiB']} | {r['store_GBps']} "
                    f"| {r['load_GBps']} | {r['store_ratio']} | {r['load_ratio']} | {r['exact']} |",
                    flush=True,
                )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
