"""Where the Mooncake tier's put and get lose against the raw client: the values' shape.

hicache's values differ from bench/tier_mooncake.py's raw ones in three ways: each is a page and
its record (a few hundred bytes more than the page), each sits in a host slot (a stride of the
value rounded up to 256 bytes, not back to back), its name is longer, and each batch goes
through the Python backend (hicache.mooncake: a thread, a future, wait and poll). This times the
raw client's batch_upsert_from / batch_get_into with each difference added one at a time, then
through MooncakeTier's own put / get / wait / poll, interleaved repetition by repetition, two
clients on loopback as in tier_mooncake.py (A puts, B gets). Each row: the median GB/s and the
median of each repetition's ratio to the first row.

    python bench/research/mooncake_shapes.py --master 127.0.0.1:50051 \\
        --metadata http://127.0.0.1:8080/metadata --pages 64 --page-kib 1024
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from hicache.mooncake import MooncakeTier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", default="127.0.0.1:50051")
    ap.add_argument("--metadata", default="http://127.0.0.1:8080/metadata")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-kib", type=int, default=1024)
    ap.add_argument("--record-bytes", type=int, default=192, help="a 16-token block's record")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    n, page = args.pages, args.page_kib << 10
    value = page + args.record_bytes
    stride = (value + 255) // 256 * 256
    variants = {  # name: (value bytes, stride, long names, through the backend)
        "raw: pages back to back": (page, page, False, False),
        "pages at a slot's stride": (page, stride, False, False),
        "page + record at a slot's stride": (value, stride, False, False),
        "the same, hicache's names": (value, stride, True, False),
        "the same, through MooncakeTier": (value, stride, True, True),
    }
    seg = (len(variants) * args.reps + 4) * n * (stride + 4096)
    ta = MooncakeTier(args.master, args.metadata, segment_bytes=seg)
    tb = MooncakeTier(args.master, args.metadata, segment_bytes=seg)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, n * stride, dtype=np.uint8)
    dst = np.zeros_like(src)
    ta.use_memory(src.ctypes.data, src.nbytes)
    tb.use_memory(dst.ctypes.data, dst.nbytes)
    for w in range(2 * seg // (n * stride) - 1):  # touch the segments once (see tier_mooncake.py)
        ta._store.batch_upsert_from([f"warm/{w}/{i}" for i in range(n)], [src.ctypes.data] * n, [page] * n)
    ta._store.remove_all()

    def through(tier: MooncakeTier, start: Callable[[], int]) -> list[int]:
        batch = start()
        while (r := tier.poll(batch)) is None:
            tier.wait(batch, 1.0)
        return r

    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for rep in range(args.reps):
        for name, (size, step, long_names, backend) in variants.items():
            # Unique per variant and repetition; hicache's are as long as tier_value_name's.
            tag = f"hicache/v1/default/{name[:4]}{rep:08x}" if long_names else f"{name[:12]}/{rep}/"
            names = [f"{tag}{i:024x}{'0' * 32}" if long_names else f"{tag}{i}" for i in range(n)]
            ps = [src.ctypes.data + i * step for i in range(n)]
            gs = [dst.ctypes.data + i * step for i in range(n)]
            t = time.perf_counter()
            if backend:
                put = through(ta, lambda names=names, ps=ps, size=size: ta.put(names, ps, [size] * n))
            else:
                put = ta._store.batch_upsert_from(names, ps, [size] * n)
            t_put = time.perf_counter() - t
            assert min(put) >= 0, put[:4]
            t = time.perf_counter()
            if backend:
                got = through(tb, lambda names=names, gs=gs, size=size: tb.get(names, gs, size))
            else:
                got = tb._store.batch_get_into(names, gs, [size] * n)
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
    ta.close()
    tb.close()


if __name__ == "__main__":
    main()
