"""hicache.sglang beside SGLang's own file backend, both driven by SGLang's HiCacheController.

    build/sglang-venv/bin/python bench/sglang_backend.py --dir /path/on/the/disk [--pages 128]
        [--page-tokens 64] [--reps 3]

In one run, on one directory, a Llama-3-8B-shaped page (32 layers, 8 KV heads of 128, fp16; 64
tokens a page: 8 MiB) in SGLang's layer-first host pool:
- raw: a sequential write, then read, of the same bytes (bench/disk_tier.py's loop);
- for hicache.sglang (tier "disk") and for SGLang's built-in "file" backend: SGLang's backup
  thread writes --pages pages (write_storage until its ack), then, with the directory's files out
  of the page cache (sync + POSIX_FADV_DONTNEED, for both backends), SGLang's prefetch threads
  ask which pages exist and read them into fresh host slots (prefetch until the last ack); every
  page read is compared with the page written.
Best of --reps; ratios are the raw loop's time over the backend's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "sglang"))
from disk_tier import raw_loop  # noqa: E402
from sglang_rig import Shape, fetch, hicache_config, make_rig, write_storage  # noqa: E402


def evict_page_cache(where: Path) -> None:
    os.sync()
    for root, _, files in os.walk(where):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def page_bytes(shape: Shape) -> int:
    return 2 * shape.layers * shape.heads * shape.head_dim * 2 * shape.page  # K and V, fp16


def one_round(backend: str, where: Path, shape: Shape, pages: int) -> tuple[float, float, int]:
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    if backend == "hicache":
        rig = make_rig(
            extra=hicache_config(tier="disk", path=str(where), capacity_bytes=4 * pages * page_bytes(shape)),
            shape=shape,
        )
    else:
        rig = make_rig(backend="file", extra={"file_storage_path": str(where)}, shape=shape)
    try:
        host = rig.host
        n = pages * shape.page
        tokens = list(range(n))
        src = host.alloc(n)
        buf = host.kv_buffer.view(torch.int64)
        buf.copy_(torch.randint(-(2**62), 2**62, buf.shape, generator=torch.Generator().manual_seed(1)))
        t0 = time.perf_counter()
        write_storage(rig, src, tokens)
        write_s = time.perf_counter() - t0
        evict_page_cache(where)
        t0 = time.perf_counter()
        loaded, dst = fetch(rig, tokens, "bench", scrub=False)
        read_s = time.perf_counter() - t0
        assert loaded == n and dst is not None, f"{backend}: prefetched {loaded} of {n} tokens"

        def page(i: int) -> torch.Tensor:  # as bytes: random bits hold NaNs, never equal as fp16
            return host.get_data_page(i, flat=True).contiguous().view(torch.uint8)

        same = sum(torch.equal(page(int(src[i])), page(int(dst[i]))) for i in range(0, n, shape.page))
        return write_s, read_s, same
    finally:
        rig.close()


def run_round(backend: str, where: Path, a: argparse.Namespace) -> tuple[float, float, int]:
    cmd = [sys.executable, "-W", "ignore", __file__, "--dir", str(where), "--pages", str(a.pages)]
    cmd += ["--page-tokens", str(a.page_tokens), "--round", backend]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900).stdout
    w, r, same = json.loads(out.strip().splitlines()[-1])
    return w, r, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure (made and removed)")
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--round", choices=("hicache", "file"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    shape = Shape(page=a.page_tokens, layers=32, heads=8, head_dim=128, tokens=a.pages * a.page_tokens)
    if a.round:  # one round in a process of its own (SGLang's pools stay until the process ends)
        print(json.dumps(one_round(a.round, Path(a.dir), shape, a.pages)))
        return
    total = a.pages * page_bytes(shape)
    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    try:
        raw_w, raw_r = min(raw_loop(base / "raw", total)[:2] for _ in range(a.reps))
        results = {}
        for backend in ("hicache", "file"):
            rounds = [run_round(backend, base / backend, a) for _ in range(a.reps)]
            assert all(r[2] == a.pages for r in rounds), f"{backend}: pages differ after the round trip"
            results[backend] = (min(r[0] for r in rounds), min(r[1] for r in rounds))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gb = total / 1e9
    print(
        f"{a.pages} pages of {page_bytes(shape) >> 20} MiB ({total >> 20} MiB), {a.page_tokens}-token pages, "
        f"layer-first host pool, best of {a.reps}; every page read back equal to the page written\n"
    )
    print("| what | backup s | GB/s | raw / it | prefetch s | GB/s | raw / it |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| raw sequential loop | {raw_w:.3f} | {gb / raw_w:.2f} | | {raw_r:.3f} | {gb / raw_r:.2f} | |")
    names = {"hicache": "hicache.sglang (disk tier)", "file": "SGLang's file backend"}
    for backend, (w, r) in results.items():
        print(
            f"| {names[backend]} | {w:.3f} | {gb / w:.2f} | {raw_w / w:.3f} | {r:.3f} | {gb / r:.2f} "
            f"| {raw_r / r:.3f} |"
        )


if __name__ == "__main__":
    main()
