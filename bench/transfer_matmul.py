"""hicache's copies beside a large bf16 matmul: the matmul's slowdown and our bandwidth.

Loads (H2D, try_resume) and stores (D2H, store) of a Llama-3-8B-shaped layer-major pool run on a
side stream while 8192^3 bf16 matmuls run on the main stream, for each copy path (staged: whole
pages on the DMA engines + an HBM scatter; kernel: the copy kernel across PCIe), and the same for
a plain DMA copy (torch copy_ from pinned memory, i.e. cudaMemcpyAsync) of the same bytes.

The baseline is the same run of matmuls, back to back, with no copy, measured just before and
just after each copy run (their mean), so clock and power drift over the benchmark cancel out.
Prints markdown rows.
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
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def matmuls() -> float:
        """Milliseconds per matmul over args.matmuls back-to-back ones on the main stream."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(main_s)
        for _ in range(args.matmuls):
            x @ x
        b.record(main_s)
        torch.cuda.synchronize()
        return a.elapsed_time(b) / args.matmuls

    matmuls()  # warm-up: clocks, cuBLAS heuristics
    prompts = [torch.arange(n * B + 1) + k * 10**6 for k in range(2)]
    target = list(range(n, 2 * n))
    # Stores need fresh prompts and room: copies queued back to back hold their slots until done.
    stores_in_flight = 16

    def make_cache(pages: int, **kw: object) -> hicache.HostPrefixCache:
        return hicache.HostPrefixCache(
            segs, block_tokens=B, capacity_pages=pages, cuda_blocks=args.cuda_blocks, pin_upfront=True, **kw
        )

    def variants(label: str, **kw: object) -> list[tuple[str, Callable[[], None], hicache.HostPrefixCache]]:
        loads = make_cache(2 * n, **kw)
        for k, pr in enumerate(prompts):
            loads.store(f"s{k}", pr, list(range(k * n, (k + 1) * n + 1)))
        torch.cuda.synchronize()
        loads.poll()
        stores = make_cache(stores_in_flight * n, **kw)
        fresh = [0]

        def load() -> None:
            got = loads.try_resume("l", prompts[0], lambda k: target[: k // B], stream=side)
            assert got == n * B, f"load served {got} tokens"
            loads.forget("l")

        def store() -> None:
            stores.poll()
            fresh[0] += 1
            got = stores.store(
                "w", torch.arange(n * B + 1) + fresh[0] * 10**7, list(range(n + 1)), stream=side
            )
            assert got == n, f"store copied {got} of {n} pages"
            stores.forget("w")

        return [
            (f"hicache load (H2D), {label}", load, loads),
            (f"hicache store (D2H), {label}", store, stores),
        ]

    pinned = torch.empty(batch_bytes, dtype=torch.uint8).pin_memory()
    dev_buf = torch.empty(batch_bytes, dtype=torch.uint8, device=dev)

    def dma_h2d() -> None:
        with torch.cuda.stream(side):
            dev_buf.copy_(pinned, non_blocking=True)

    def dma_d2h() -> None:
        with torch.cuda.stream(side):
            pinned.copy_(dev_buf, non_blocking=True)

    def dma_runs() -> list[tuple[str, Callable[[], None], hicache.HostPrefixCache | None]]:
        return [("cudaMemcpyAsync H2D", dma_h2d, None), ("cudaMemcpyAsync D2H", dma_d2h, None)]

    # Each group's caches (up to 18 GiB of pinned memory) live only while the group runs.
    groups: list[Callable[[], list[tuple[str, Callable[[], None], hicache.HostPrefixCache | None]]]] = [
        lambda: variants("staged (default: 2 windows)"),
        lambda: variants("staged, 8 windows", cuda_staging_windows=8),
        lambda: variants("staged, priority stream", cuda_staging_priority=True),
        lambda: variants(
            "staged, priority stream, 8 windows", cuda_staging_windows=8, cuda_staging_priority=True
        ),
        lambda: variants("kernel", cuda_staging_bytes=0),
        dma_runs,
    ]

    def run(name: str, fn: Callable[[], None], cache: hicache.HostPrefixCache | None) -> tuple:
        copy_alone = timed(side, fn, 10)
        torch.cuda.synchronize()
        if cache is not None:
            cache.poll()
        per_mm_alone = matmuls()
        k = max(4, int(args.matmuls * per_mm_alone / copy_alone) + 4)  # copies outlast the matmuls
        if "store" in name:
            k = min(k, stores_in_flight - 1)
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0.record(side)
        for _ in range(k):
            fn()
        c1.record(side)
        per_mm = matmuls()
        copy_bw = k * batch_bytes / (c0.elapsed_time(c1) * 1e6)
        if cache is not None:
            cache.poll()
        after = matmuls()
        base = (per_mm_alone + after) / 2
        return (name, batch_bytes / (copy_alone * 1e6), copy_bw, base, per_mm / base - 1)

    rows = []
    for group in groups:
        # The group's list is the only owner of its caches: they (and their pinned pools) are
        # freed once it is done, before the next group pins its own.
        rows += [run(*variant) for variant in group()]
        torch.cuda.synchronize()
    flops = 2 * 8192**3 / (rows[0][3] * 1e-3) / 1e12
    print(
        f"bf16 8192^3 matmul alone: {rows[0][3]:.3f} ms ({flops:.0f} TFLOP/s); copies of "
        f"{batch_bytes / 1e9:.2f} GB ({n} pages of {page_bytes >> 20} MiB), "
        f"copy kernels with {args.cuda_blocks} CTAs\n"
    )
    print(
        "| copy on a side stream | alone GB/s | beside the matmul GB/s | matmul ms alone | matmul slowdown |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name, bw_alone, bw, base, slow in rows:
        print(f"| {name} | {bw_alone:.1f} | {bw:.1f} | {base:.3f} | {slow * 100:+.1f} % |")


if __name__ == "__main__":
    main()
