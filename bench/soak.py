"""Soak: mixed operations at full pool occupancy for a while; resident memory and slot accounting
must stay flat.

    python bench/soak.py --minutes 10 [--device cuda]

Every request stores and resumes prefixes of a rotating set of conversations whose pages exceed
the pool, so the pool is full and evicting the whole time; some requests are forgotten before
their copies complete (aborts), the others a few requests later (as an engine forgets a request
when its decoding ends), some allocations are refused. Every few seconds it samples RSS and the
cache's counters. At the end it fails unless RSS after warm-up grew by less than --max-rss-growth
MiB, nothing is left busy or in flight once drained, the pool is exactly full, and every loaded
page checked (all on the CPU, every fourth hit on a GPU) holds what was stored for it; on a GPU,
free device memory (the copier's staging, segment tables, events) must not shrink after warm-up
by more than --max-gpu-growth MiB either.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch

import hicache


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def gpu_used_mib(dev: torch.device) -> float:
    """Device memory this process holds (torch's allocator and the copier's cudaMalloc alike), as
    nvidia-smi reports it per process: other processes on the GPU do not count. NaN where that
    is not available; 0 on the CPU."""
    if dev.type != "cuda":
        return 0.0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return math.nan
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip() == str(os.getpid()) and mib.strip().isdigit():
            return float(mib)
    return math.nan


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--pages", type=int, default=512, help="host pool capacity in pages")
    p.add_argument("--max-rss-growth", type=float, default=32.0, help="MiB allowed after warm-up")
    p.add_argument("--max-gpu-growth", type=float, default=8.0, help="device MiB allowed after warm-up")
    p.add_argument(
        "--live", type=int, default=8, help="requests in progress: forgotten this many requests later"
    )
    args = p.parse_args()
    B, blocks = 128, 1024
    dev = torch.device(args.device)
    segs = [torch.zeros(blocks, B, 8, 64, dtype=torch.int16, device=dev) for _ in range(8)]  # 1 MiB pages
    # Write-through: every store copies and evicts, the churn this soak is about.
    cache = hicache.HostPrefixCache(
        segs, block_tokens=B, capacity_pages=args.pages, pin_upfront=True, admission="always"
    )
    rng = np.random.default_rng(0)
    convs = [rng.integers(0, 50000, size=int(rng.integers(8, 40)) * B + 17) for _ in range(64)]  # ~1500 pages
    t_end = time.time() + args.minutes * 60
    samples, ops, n = [], 0, 0
    live: collections.deque[str] = collections.deque()
    next_sample = time.time()
    verified = wrong = hits_seen = 0
    verify_every = 4 if dev.type == "cuda" else 1  # a check synchronizes the GPU
    while time.time() < t_end:
        c = int(rng.integers(0, len(convs)))
        conv = convs[c]
        prompt = conv[: int(rng.integers(B + 1, len(conv) + 1))]
        table = [int(b) for b in rng.choice(blocks, size=len(prompt) // B + 1, replace=False)]
        full = len(prompt) // B
        idx = torch.tensor(table[:full], device=dev)
        # Page i of conversation c holds the value c*64+i+1 everywhere: what "prefill" writes.
        pattern = torch.arange(full, device=dev, dtype=torch.int16) + (c * 64 + 1)
        rid = f"r{n}"
        n += 1
        refuse = rng.random() < 0.1
        for seg in segs:
            seg[idx] = -1  # poison: a load that did not happen cannot pass for one that did
        got = cache.try_resume(rid, prompt, lambda k, t=table, r=refuse: None if r else t[: k // B])
        if got > 0:
            hits_seen += 1
            if hits_seen % verify_every == 0:
                k = got // B
                for seg in segs:
                    ok_pages = (seg[idx[:k]] == pattern[:k, None, None, None]).flatten(1).all(1)
                    wrong += int((~ok_pages).sum().item())
                    verified += k
        for seg in segs:
            seg[idx] = pattern[:, None, None, None]
        cache.store(rid, prompt, table)
        cache.poll()
        if rng.random() < 0.1:
            cache.forget(rid)  # aborted at once: on a GPU its store is usually still in flight
        else:
            live.append(rid)  # finishes later, as a request decodes for a while after its store
        while len(live) > args.live:
            cache.forget(live.popleft())
        ops += 4
        if time.time() >= next_sample:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            s = cache.stats()
            used_gpu = gpu_used_mib(dev)
            samples.append(
                (time.time(), rss_mib(), used_gpu, s.pages_used, s.pages_busy, s.transfers_in_flight, ops)
            )
            next_sample += 10
    if dev.type == "cuda":
        torch.cuda.synchronize()
    cache.poll()
    while live:
        cache.forget(live.popleft())
    s = cache.stats()
    # Flat = no growth after warm-up (the first fifth of the run: pools, event pools and
    # staging reach their high-water marks); a leak grows with the operations.
    w = next(
        (i for i, x in enumerate(samples) if x[0] - samples[0][0] >= args.minutes * 12), len(samples) - 1
    )
    warm, peak = samples[w][1], max(x[1] for x in samples[w:])
    gpu_warm, gpu_peak = samples[w][2], max(x[2] for x in samples[w:])
    print(
        f"{ops} operations in {args.minutes} min on {args.device}: {s.lookups} lookups, {s.hits} hits, "
        f"{s.pages_stored} pages stored, {s.pages_evicted} evicted, {s.errors} errors; "
        f"{verified} loaded page segments checked against what was stored, {wrong} wrong"
    )
    print(
        f"RSS after warm-up {warm:.1f} MiB, peak later {peak:.1f} MiB; "
        f"device memory in use after warm-up {gpu_warm:.1f} MiB, peak later {gpu_peak:.1f} MiB; "
        f"pool {s.pages_used}/{s.pages_capacity} pages, busy {s.pages_busy}, "
        f"in flight {s.transfers_in_flight}, requests known {s.requests}"
    )
    print("| t (s) | RSS (MiB) | device MiB in use | pages used | busy | in flight | operations |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    t0 = samples[0][0]
    for t, rss, gpu, used, busy, fl, o in samples[:: max(1, len(samples) // 12)]:
        print(f"| {t - t0:.0f} | {rss:.1f} | {gpu:.1f} | {used} | {busy} | {fl} | {o} |")
    ok = (
        peak - warm < args.max_rss_growth
        and not gpu_peak - gpu_warm >= args.max_gpu_growth  # NaN (not measurable) passes
        and s.pages_busy == 0
        and s.transfers_in_flight == 0
        and s.pages_used == s.pages_capacity
        and s.requests == 0
        and s.errors == 0
        and wrong == 0
        and verified > 0
    )
    print("flat and consistent:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
