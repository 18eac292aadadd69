"""Where a store or load call's CPU time goes on the GPU path: the CUDA calls it makes.

For engines' pools of small blocks (the rows of `bench/layouts.py --engines` whose calls hold
about 1000 pages), on the GPU with default options: how long a store and a load take to return
(best of 7), the same calls with ``copier="null"`` (hashing and the index, no copy), and one call
of each under torch's profiler, whose CUDA runtime events (CUPTI) give each CUDA call's count and
time on the calling thread. The profiler adds its own cost per event, so its totals read high;
the counts are exact.

    python3 bench/research/call_profile.py
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import hicache

sys.path.insert(0, str(Path(__file__).parent.parent))  # bench/, for layouts.py
import layouts as L  # the grid's layout, cache and timing helpers

POOLS = [  # (model, block tokens, chunk bytes, segments, pages a call)
    ("Llama-3-70B, TP8", 16, 16 * 256, 160, 1024),
    ("DeepSeek-V3 MLA", 16, 16 * 1152, 61, 954),
    ("gpt-oss-120b", 16, 16 * 1024, 72, 910),
    ("Llama-3-8B", 16, 16 * 2048, 64, 512),
]


def returns(call: object, tidy: object, reps: int = 7) -> float:
    """Seconds until call() returns, best of reps, tidy() between."""
    best = float("inf")
    for _ in range(reps):
        tidy()  # type: ignore[operator]
        t0 = time.perf_counter()
        call()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    tidy()  # type: ignore[operator]
    return best


def runtime_calls(call: object) -> dict[str, tuple[int, float]]:
    """CUDA runtime calls made by call(): name -> (count, us on the calling thread)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()  # type: ignore[operator]
        torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.name.startswith("cuda") and e.device_type == torch.autograd.DeviceType.CPU:
            out[e.name][0] += 1
            out[e.name][1] += e.cpu_time_total
    return {k: (int(v[0]), v[1]) for k, v in out.items()}


def profile_pool(model: str, tokens: int, chunk: int, nseg: int, pages: int) -> None:
    p = L.Point(chunk, nseg, pages, "auto", capacity=2, tokens=tokens)

    def store() -> None:
        p.store(p.fresh(), p.s1)

    def load() -> None:
        p.load(p.s1)

    st = returns(store, p.sync)
    ld = returns(load, p.sync)
    null = hicache.HostPrefixCache(
        p.segs, block_tokens=tokens, capacity_pages=4 * pages, copier="null", admission="always"
    )
    prompts = [p.prompt() for _ in range(8)]
    null.store("c", prompts[0], p.sources)
    n = [0]

    def null_store() -> None:
        n[0] += 1
        null.store(f"x{n[0]}", prompts[n[0]], p.sources)

    def null_load() -> None:
        got = null.try_resume("r", prompts[0], lambda k: p.targets[: k // tokens])
        null.forget("r")
        if got != pages * tokens:
            raise SystemExit(f"the null copier's load found {got} of {pages * tokens} tokens")

    # The load first: the stores after it fill the pool and evict the prompt it loads.
    nld = returns(null_load, lambda: None)
    nst = returns(null_store, lambda: None)
    p.sync()
    prompt = p.fresh()
    calls = {"store": runtime_calls(lambda: p.store(prompt, p.s1))}
    p.sync()
    calls["load"] = runtime_calls(lambda: p.load(p.s1))
    p.sync()
    mib = chunk * nseg / 2**20
    print(f"\n### {model}, {tokens}-token blocks: {nseg} x {chunk >> 10} KiB ({mib:.2f} MiB), {pages} pages")
    print(
        f"path {p.path}; us a page until the call returns: store {st / pages * 1e6:.2f} "
        f"(null copier {nst / pages * 1e6:.2f}), load {ld / pages * 1e6:.2f} "
        f"(null copier {nld / pages * 1e6:.2f})"
    )
    print("\n| call | CUDA call | count | count a page | us (profiled) |")
    print("| --- | --- | --- | --- | --- |")
    for what, table in calls.items():
        for name, (count, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            print(f"| {what} | {name} | {count} | {count / pages:.3f} | {us:.0f} |")


def main() -> None:
    if not torch.cuda.is_available() or not hicache.cuda_available():
        sys.exit("needs a CUDA GPU and a CUDA build of hicache")
    for pool in POOLS:
        profile_pool(*pool)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
