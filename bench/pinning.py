"""How fast the host pool is pinned, with transparent huge pages and without.

Times the construction of a ``SlotMover`` whose slots (``--gib`` of them in all, pinned at
construction in 1 GiB chunks: mmap, faulting on every core, ``cudaHostRegister``) are the same
memory a ``HostPrefixCache`` pins, alternately as hicache asks for it (huge pages where the
kernel allows them) and with THP disabled for the process (``prctl(PR_SET_THP_DISABLE)``, so the
pool has 4 KiB pages). Prints GB/s per run and how much of the process was in huge pages.

    python3 bench/pinning.py [--gib 8] [--runs 3]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

import hicache

PR_SET_THP_DISABLE = 41


def huge_mib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) >> 10
    return 0


def pin(gib: int, slot_bytes: int) -> tuple[float, int]:
    segs = [torch.empty(2, slot_bytes, dtype=torch.uint8, device="cuda")]
    t0 = time.perf_counter()
    mover = hicache._core.SlotMover(segs, (gib << 30) // slot_bytes, "auto", None, False, 1 << 30)
    seconds = time.perf_counter() - t0
    huge = huge_mib()
    del mover
    return seconds, huge


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    print("| run | pages | seconds | GB/s | in huge pages |")
    print("| --- | --- | --- | --- | --- |")
    for run in range(args.runs):
        for thp in (True, False):
            if libc.prctl(PR_SET_THP_DISABLE, 0 if thp else 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE)")
            seconds, huge = pin(args.gib, 16 << 20)
            label = "huge where allowed" if thp else "4 KiB (THP disabled)"
            print(
                f"| {run + 1} | {label} | {seconds:.2f} | {(args.gib << 30) / seconds / 1e9:.1f} "
                f"| {huge} MiB |",
                flush=True,
            )


if __name__ == "__main__":
    main()
