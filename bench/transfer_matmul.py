"""hicache's copies beside a large bf16 matmul: the matmul's slowdown and our bandwidth.

Loads (H2D, try_resume) and stores (D2H, store) of a Llama-3-8B-shaped layer-major pool run on a
side stream while 8192^3 bf16 matmuls run on the main stream; the same for a plain DMA copy
(torch copy_ from pinned memory, i.e. cudaMemcpyAsync) of the same bytes. Prints markdown rows.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

import hicache

B = 128


def timed(stream: torch.cuda.Stream, fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--matmuls", type=int, default=200)
    p.add_argument("--cuda-blocks", type=int, default=4)
    args = p.parse_args()
    dev = torch.device("cuda")
    main_s, side = torch.cuda.current_stream(), torch.cuda.Stream()
    n = args.pages
    segs = [torch.randn(2 * n + 2, B, 8, 128, device=dev).to(torch.bfloat16) for _ in range(64)]
    page_bytes = sum(s[0].numel() * s.element_size() for s in segs)
    batch_bytes = page_bytes * n
    cache = hicache.HostPrefixCache(
        segs, block_tokens=B, capacity_pages=2 * n, cuda_blocks=args.cuda_blocks, pin_upfront=True
    )
    prompts = [torch.arange(n * B + 1) + k * 10**6 for k in range(2)]
    for k, pr in enumerate(prompts):
        cache.store(f"s{k}", pr, list(range(k * n, (k + 1) * n + 1)))
    torch.cuda.synchronize()
    cache.poll()
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(5):
        x @ x
    torch.cuda.synchronize()
    alone = timed(main_s, lambda: x @ x, 30)
    flops = 2 * 8192**3 / (alone * 1e-3) / 1e12

    target = list(range(n, 2 * n))

    def load() -> None:
        cache.try_resume("l", prompts[0], lambda k: target[: k // B], stream=side)

    pinned = torch.empty(batch_bytes, dtype=torch.uint8).pin_memory()
    dev_buf = torch.empty(batch_bytes, dtype=torch.uint8, device=dev)

    def dma_h2d() -> None:
        with torch.cuda.stream(side):
            dev_buf.copy_(pinned, non_blocking=True)

    def dma_d2h() -> None:
        with torch.cuda.stream(side):
            pinned.copy_(dev_buf, non_blocking=True)

    # Stores need fresh prompts and room: copies queued back to back hold their slots until done.
    stores_in_flight = 16

    def fresh_pool() -> hicache.HostPrefixCache:
        return hicache.HostPrefixCache(
            segs,
            block_tokens=B,
            capacity_pages=stores_in_flight * n,
            cuda_blocks=args.cuda_blocks,
            pin_upfront=True,
        )

    big = fresh_pool()
    fresh = [0]

    def store() -> None:
        big.poll()
        fresh[0] += 1
        got = big.store("w", torch.arange(n * B + 1) + fresh[0] * 10**7, list(range(n + 1)), stream=side)
        assert got == n, f"store copied {got} of {n} pages"

    rows = []
    for name, fn in [
        ("hicache load (H2D)", load),
        ("hicache store (D2H)", store),
        ("cudaMemcpyAsync H2D", dma_h2d),
        ("cudaMemcpyAsync D2H", dma_d2h),
    ]:
        copy_alone = timed(side, fn, 10)
        torch.cuda.synchronize()
        k = max(4, int(args.matmuls * alone / copy_alone) + 4)  # copies outlast the matmuls
        if fn is store:
            torch.cuda.synchronize()
            big.poll()
            big = fresh_pool()  # empty again: room for k stores in flight
            k = min(k, stores_in_flight - 1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0.record(side)
        for _ in range(k):
            fn()
        c1.record(side)
        a.record(main_s)
        for _ in range(args.matmuls):
            x @ x
        b.record(main_s)
        torch.cuda.synchronize()
        per_mm = a.elapsed_time(b) / args.matmuls
        copy_bw = k * batch_bytes / (c0.elapsed_time(c1) * 1e6)
        rows.append((name, batch_bytes / (copy_alone * 1e6), copy_bw, per_mm / alone - 1))
        cache.poll()
    print(
        f"bf16 8192^3 matmul alone: {alone:.3f} ms ({flops:.0f} TFLOP/s); copies of "
        f"{batch_bytes / 1e9:.2f} GB ({n} pages of {page_bytes >> 20} MiB), "
        f"hicache kernel with {args.cuda_blocks} CTAs\n"
    )
    print("| copy on a side stream | alone GB/s | beside the matmul GB/s | matmul slowdown |")
    print("| --- | --- | --- | --- |")
    for name, bw_alone, bw, slow in rows:
        print(f"| {name} | {bw_alone:.1f} | {bw:.1f} | {slow * 100:+.1f} % |")


if __name__ == "__main__":
    main()
