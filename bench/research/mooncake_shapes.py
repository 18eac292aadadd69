"""Where the Mooncake tier's put and get lose against the raw client: the values' shape.

hicache's values differ from bench/tier_mooncake.py's raw ones in three ways: each is a page and
its record (a few hundred bytes more than the page), each sits in a host slot (a stride of the
value rounded up to 256 bytes, not back to back), its name is longer, and each batch goes
through the Python backend (hicache.mooncake: a thread, a future, wait and poll). This times the
raw client's batch_upsert_from / batch_get_into with each difference added one at a time, then
through MooncakeTier's own put / get / wait / poll, interleaved repetition by repetition, two
clients on loopback as in tier_mooncake.py (A puts, B gets). Each row: the median GB/s and the
median of each repetition's ratio to the first row.

`--halves` adds rows of the raw client's values in two batches of half the pages each: one
after the other (how hicache's tier thread puts a round of the buffer at a time), and both at
once from two threads (how its gets keep the next round in flight).

`--memory` adds rows of the raw client over buffers in other memory than numpy's: anonymous
mmap on 2 MiB pages touched on one thread, the same touched on every core (how hicache's pinned
allocator faults its pool in), and that registered with CUDA (`cudaHostRegister`, portable and
mapped, as hicache's GPU pools are; needs torch with CUDA). It prints the NUMA nodes each buffer
landed on (/proc/self/numa_maps).

    python bench/research/mooncake_shapes.py --master 127.0.0.1:50051 \\
        --metadata http://127.0.0.1:8080/metadata --pages 64 --page-kib 1024
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hicache.mooncake import MooncakeTier

HUGE = 2 << 20


def mapped(nbytes: int, threads: int) -> tuple[np.ndarray, mmap.mmap]:
    """nbytes of anonymous memory on 2 MiB pages, its pages first touched on `threads` threads."""
    m = mmap.mmap(-1, nbytes + HUGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    skip = -base % HUGE
    m.madvise(mmap.MADV_HUGEPAGE)
    per = (nbytes // threads + HUGE - 1) // HUGE * HUGE

    def touch(t: int) -> None:  # ctypes releases the GIL: the threads fault in parallel
        begin = t * per
        if begin < nbytes:
            ctypes.memset(base + skip + begin, 0, min(per, nbytes - begin))

    pool = [threading.Thread(target=touch, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return np.frombuffer(m, np.uint8, nbytes, skip), m


def numa_nodes(addr: int) -> str:
    """The N<node>=<pages> fields of the numa_maps line of the mapping holding addr."""
    with open("/proc/self/numa_maps") as f:
        maps = [line.split() for line in f]
    below = [m for m in maps if int(m[0], 16) <= addr]
    fields = max(below, key=lambda m: int(m[0], 16)) if below else []
    return " ".join(x for x in fields if x.startswith("N")) or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", default="127.0.0.1:50051")
    ap.add_argument("--metadata", default="http://127.0.0.1:8080/metadata")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-kib", type=int, default=1024)
    ap.add_argument("--record-bytes", type=int, default=192, help="a 16-token block's record")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--memory", action="store_true", help="also the raw client over other memory")
    ap.add_argument("--halves", action="store_true", help="also the raw client's values in two batches")
    args = ap.parse_args()
    n, page = args.pages, args.page_kib << 10
    value = page + args.record_bytes
    stride = (value + 255) // 256 * 256
    # name: (value bytes, stride, long names, through the backend, memory, batches)
    variants: dict[str, tuple[int, int, bool, bool, str, str]] = {
        "raw: pages back to back": (page, page, False, False, "numpy", "one"),
        "pages at a slot's stride": (page, stride, False, False, "numpy", "one"),
        "page + record at a slot's stride": (value, stride, False, False, "numpy", "one"),
        "the same, hicache's names": (value, stride, True, False, "numpy", "one"),
        "the same, through MooncakeTier": (value, stride, True, True, "numpy", "one"),
    }
    if args.halves:
        variants |= {
            "raw, two batches one after the other": (page, page, False, False, "numpy", "serial"),
            "raw, two batches at once": (page, page, False, False, "numpy", "overlap"),
        }
    if args.memory:
        variants |= {
            "raw, 2 MiB pages touched on one thread": (page, page, False, False, "huge1", "one"),
            "raw, 2 MiB pages touched on every core": (page, page, False, False, "huge", "one"),
            "raw, the same registered with CUDA": (page, page, False, False, "pinned", "one"),
        }
    seg = (len(variants) * args.reps + 4) * n * (stride + 4096)
    ta = MooncakeTier(args.master, args.metadata, segment_bytes=seg)
    tb = MooncakeTier(args.master, args.metadata, segment_bytes=seg)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, n * stride, dtype=np.uint8)
    keep: list[object] = []  # the mappings behind the buffers

    def buffer(memory: str) -> np.ndarray:
        if memory == "numpy":
            return np.zeros_like(data)
        buf, m = mapped(data.nbytes, 1 if memory == "huge1" else os.cpu_count() or 1)
        keep.append(m)
        if memory == "pinned":
            import torch

            err = torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, buf.nbytes, 3)
            assert int(err) == 0, f"cudaHostRegister: {err}"
        return buf

    memories = {v[4] for v in variants.values()}
    bufs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for memory in sorted(memories):
        src, dst = buffer(memory), buffer(memory)
        src[:] = data
        ta.use_memory(src.ctypes.data, src.nbytes)
        tb.use_memory(dst.ctypes.data, dst.nbytes)
        bufs[memory] = (src, dst)
        if args.memory:
            print(f"{memory}: src {numa_nodes(src.ctypes.data)}; dst {numa_nodes(dst.ctypes.data)}")
    src = bufs["numpy"][0]
    for w in range(2 * seg // (n * stride) - 1):  # touch the segments once (see tier_mooncake.py)
        ta._store.batch_upsert_from([f"warm/{w}/{i}" for i in range(n)], [src.ctypes.data] * n, [page] * n)
    ta._store.remove_all()

    two = ThreadPoolExecutor(2)

    def halves(
        call: Callable[..., list[int]], names: list[str], ptrs: list[int], size: int, how: str
    ) -> list[int]:
        """The raw call over all the values, or over each half of them (serial or at once)."""
        if how == "one":
            return list(call(names, ptrs, [size] * len(names)))
        h = len(names) // 2
        parts = [(names[:h], ptrs[:h]), (names[h:], ptrs[h:])]
        if how == "serial":
            return [x for nm, p in parts for x in call(nm, p, [size] * len(nm))]
        futs = [two.submit(call, nm, p, [size] * len(nm)) for nm, p in parts]
        return [x for f in futs for x in f.result()]

    def through(tier: MooncakeTier, start: Callable[[], int]) -> list[int]:
        batch = start()
        while (r := tier.poll(batch)) is None:
            tier.wait(batch, 1.0)
        return r

    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for rep in range(args.reps):
        for k, (name, (size, step, long_names, backend, memory, how)) in enumerate(variants.items()):
            src, dst = bufs[memory]
            # Unique per variant and repetition; hicache's are as long as tier_value_name's.
            tag = f"hicache/v1/default/{k:04x}{rep:08x}" if long_names else f"v{k}/{rep}/"
            names = [f"{tag}{i:024x}{'0' * 32}" if long_names else f"{tag}{i}" for i in range(n)]
            ps = [src.ctypes.data + i * step for i in range(n)]
            gs = [dst.ctypes.data + i * step for i in range(n)]
            t = time.perf_counter()
            if backend:
                put = through(ta, lambda names=names, ps=ps, size=size: ta.put(names, ps, [size] * n))
            else:
                put = halves(ta._store.batch_upsert_from, names, ps, size, how)
            t_put = time.perf_counter() - t
            assert min(put) >= 0, put[:4]
            t = time.perf_counter()
            if backend:
                got = through(tb, lambda names=names, gs=gs, size=size: tb.get(names, gs, size))
            else:
                got = halves(tb._store.batch_get_into, names, gs, size, how)
            t_get = time.perf_counter() - t
            assert min(got) == size, got[:4]
            times[name].append((t_put, t_get))
    gb = n * page / 1e9
    shape = f"{n} values of {args.page_kib} KiB (+{args.record_bytes} B record, slots of {stride} B)"
    print(f"{shape}; {args.reps} reps")
    print("| values | put GB/s | put / raw | get GB/s | get / raw |")
    print("| --- | --- | --- | --- | --- |")
    base = times["raw: pages back to back"]
    med = statistics.median
    for name, ts in times.items():
        put_r = med(b[0] / t[0] for b, t in zip(base, ts, strict=True))
        get_r = med(b[1] / t[1] for b, t in zip(base, ts, strict=True))
        print(
            f"| {name} | {gb / med(t[0] for t in ts):.2f} | {put_r:.3f} | "
            f"{gb / med(t[1] for t in ts):.2f} | {get_r:.3f} |"
        )
    two.shutdown()
    ta.close()
    tb.close()


if __name__ == "__main__":
    main()
