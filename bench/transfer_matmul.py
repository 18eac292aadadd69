"""hicache's copies beside a large bf16 matmul: the matmul's slowdown and our bandwidth.

For each layout class (Llama-3-8B layer-major, DeepSeek MLA, a TP-sharded or small model, an
MoE-sized model, one page-major pool, small page-major pages), loads (H2D, try_resume) and stores
(D2H, store) run on a side stream while 8192^3 bf16 matmuls run on the main stream, on the default
path and on each forced one (``--paths``), and the same for a plain DMA copy (torch copy_ from
pinned memory, i.e. cudaMemcpyAsync) of the same bytes, and that copy staged with torch alone
(32 MiB windows, each a DMA copy and an elementwise kernel within the GPU: any staging's own cost).

The baseline is the same run of matmuls, back to back, with no copy, measured just before and
just after each copy run (their mean), so clock and power drift over the benchmark cancel out.
Each variant is measured ``--rounds`` times and reported by its median round (the matmul's
slowdown swings by a few percent from one round to the next on an H100, a plain copy's too), with
the rounds' range beside it. ``--staging-mib`` runs the staged and default paths once for each
staging size (``cuda_staging_bytes``), ``--cuda-blocks`` every path but DMA once for each CTA
count. Prints markdown rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
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


LAYOUTS = {  # name: (segments, bytes per block per segment)
    "Llama-3-8B, 64 x 256 KiB": (64, 256 << 10),
    "MLA, 61 x 144 KiB": (61, 144 << 10),
    "TP shard / small model, 48 x 32 KiB": (48, 32 << 10),
    "MoE-sized, 96 x 128 KiB": (96, 128 << 10),
    "page-major, 1 x 16 MiB": (1, 16 << 20),
    "small page-major pages, 1 x 256 KiB": (1, 256 << 10),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-mib", type=int, default=1024, help="bytes per copy call")
    p.add_argument("--matmuls", type=int, default=200)
    p.add_argument("--paths", type=lambda v: v.split(","), default=["auto", "dma", "staged", "kernel"])
    p.add_argument("--layouts", type=lambda v: v.split(";"), default=list(LAYOUTS))
    p.add_argument("--rounds", type=int, default=3, help="measurements of each variant (the median is shown)")
    p.add_argument(
        "--staging-mib",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[64],
        help="cuda_staging_bytes in MiB for the staged and default paths, one run each",
    )
    p.add_argument(
        "--cuda-blocks",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[],
        help="cuda_blocks for every path but dma, one run each (default: the option's default); "
        "the staged path takes at least min(SMs / 4, 32)",
    )
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; known: {list(LAYOUTS)}")
    dev = torch.device("cuda")
    main_s, side = torch.cuda.current_stream(), torch.cuda.Stream()
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for name in args.layouts:
        nseg, chunk = LAYOUTS[name]
        n = max(8, (args.batch_mib << 20) // (nseg * chunk))
        print(f"\n### {name}: {n} pages of {nseg * chunk / 2**20:.2f} MiB a call\n", flush=True)
        run_layout(args, dev, main_s, side, x, nseg, chunk, n)
        torch.cuda.empty_cache()


def run_layout(args, dev, main_s, side, x, nseg: int, chunk: int, n: int) -> None:
    segs = [torch.empty(2 * n + 2, chunk, dtype=torch.uint8, device=dev).random_(0, 255) for _ in range(nseg)]
    page_bytes = nseg * chunk
    batch_bytes = page_bytes * n

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
    prompts = [torch.arange(n * B + 1, dtype=torch.int32) + k * 10**6 for k in range(2)]
    target = list(range(n, 2 * n))
    blocks = list(range(n + 1))
    # Stores need fresh prompts and room: copies queued back to back hold their slots until done.
    stores_in_flight = 16

    def make_cache(pages: int, **kw: object) -> hicache.HostPrefixCache:
        # admission="always": every store copies (this measures copies, not the policy)
        return hicache.HostPrefixCache(
            segs, block_tokens=B, capacity_pages=pages, pin_upfront=True, admission="always", **kw
        )

    def variants(label: str, **kw: object) -> list[tuple[str, Callable[[], None], hicache.HostPrefixCache]]:
        loads = make_cache(2 * n, **kw)
        for k, pr in enumerate(prompts):
            loads.store(f"s{k}", pr, list(range(k * n, (k + 1) * n + 1)))
        torch.cuda.synchronize()
        loads.poll()
        stores = make_cache(stores_in_flight * n, **kw)
        # Every store's prompt is made before any store is timed (int32: nothing to convert).
        # Made in the timed call, an arange and an add of 131K tokens took ~16 ms each the first
        # six times in a process on a 2-core machine (then 0.1 ms), and on an H100 host
        # 1024-page stores timed alone ran at 10.9 GB/s, where bench/layouts.py (prompts made
        # before the call) stores the same pages at 0.93 of the link. A round stores 10 alone and
        # at most stores_in_flight - 1 beside the matmuls.
        count = args.rounds * (10 + stores_in_flight)
        fresh = iter([torch.arange(n * B + 1, dtype=torch.int32) + k * 10**7 for k in range(1, 1 + count)])

        def load() -> None:
            got = loads.try_resume("l", prompts[0], lambda k: target[: k // B], stream=side)
            assert got == n * B, f"load served {got} tokens"
            loads.forget("l")

        def store() -> None:
            stores.poll()
            got = stores.store("w", next(fresh), blocks, stream=side)
            assert got == n, f"store copied {got} of {n} pages"
            stores.forget("w")

        label = f"{label} ({loads.copy_path})"
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

    # The staged path's own work with torch alone: each 32 MiB window (the staged path's largest)
    # crosses PCIe as one DMA copy and a kernel moves it within the GPU (an elementwise kernel
    # over int64 words, not copy_, which the driver may hand to the copy engines). What any
    # staging costs a matmul that holds every SM, with none of hicache's own work.
    window = min(batch_bytes, 32 << 20)
    stage = torch.empty(window, dtype=torch.uint8, device=dev)

    def words(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int64)

    def staged_h2d() -> None:
        with torch.cuda.stream(side):
            for off in range(0, batch_bytes, window):
                n = min(window, batch_bytes - off)
                stage[:n].copy_(pinned[off : off + n], non_blocking=True)
                torch.bitwise_or(words(stage[:n]), 0, out=words(dev_buf[off : off + n]))

    def staged_d2h() -> None:
        with torch.cuda.stream(side):
            for off in range(0, batch_bytes, window):
                n = min(window, batch_bytes - off)
                torch.bitwise_or(words(dev_buf[off : off + n]), 0, out=words(stage[:n]))
                pinned[off : off + n].copy_(stage[:n], non_blocking=True)

    def dma_runs() -> list[tuple[str, Callable[[], None], hicache.HostPrefixCache | None]]:
        return [
            ("cudaMemcpyAsync H2D", dma_h2d, None),
            ("cudaMemcpyAsync D2H", dma_d2h, None),
            ("torch staging: H2D, then a kernel", staged_h2d, None),
            ("torch staging: a kernel, then D2H", staged_d2h, None),
        ]

    def stagings(path: str) -> list[int]:
        return args.staging_mib if path in ("auto", "staged") else args.staging_mib[:1]

    def ctas_of(path: str) -> list[int | None]:
        return [None] if path == "dma" or not args.cuda_blocks else list(args.cuda_blocks)

    # Each group's caches (up to 18 GiB of pinned memory) live only while the group runs.
    groups: list[Callable[[], list[tuple[str, Callable[[], None], hicache.HostPrefixCache | None]]]] = [
        *[
            lambda path=path, mib=mib, ctas=ctas: variants(
                ", ".join(
                    ["default" if path == "auto" else path]
                    + ([f"{mib} MiB staging"] if len(stagings(path)) > 1 else [])
                    + ([f"cuda_blocks={ctas}"] if len(ctas_of(path)) > 1 else [])
                ),
                cuda_path=path,
                cuda_staging_bytes=mib << 20,
                **({} if ctas is None else {"cuda_blocks": ctas}),
            )
            for path in args.paths
            for mib in stagings(path)
            for ctas in ctas_of(path)
        ],
        dma_runs,
    ]

    def one_round(name: str, fn: Callable[[], None], cache: hicache.HostPrefixCache | None) -> tuple:
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
        return (batch_bytes / (copy_alone * 1e6), copy_bw, base, per_mm / base - 1)

    def run(name: str, fn: Callable[[], None], cache: hicache.HostPrefixCache | None) -> tuple:
        rounds = sorted((one_round(name, fn, cache) for _ in range(args.rounds)), key=lambda r: r[3])
        bw_alone, bw, base, slow = rounds[len(rounds) // 2]
        return (name, bw_alone, bw, base, slow, rounds[0][3], rounds[-1][3])

    rows = []
    for group in groups:
        # The group's list is the only owner of its caches: they (and their pinned pools) are
        # freed once it is done, before the next group pins its own.
        rows += [run(*variant) for variant in group()]
        torch.cuda.synchronize()
    flops = 2 * 8192**3 / (rows[0][3] * 1e-3) / 1e12
    print(
        f"bf16 8192^3 matmul alone: {rows[0][3]:.3f} ms ({flops:.0f} TFLOP/s); copies of "
        f"{batch_bytes / 1e9:.2f} GB\n"
    )
    print(
        "| copy on a side stream | alone GB/s | beside the matmul GB/s | of alone | matmul ms alone "
        f"| matmul slowdown (median of {args.rounds}) | the rounds' range |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, bw_alone, bw, base, slow, lo, hi in rows:
        print(
            f"| {name} | {bw_alone:.1f} | {bw:.1f} | {bw / bw_alone:.2f} | {base:.3f} | {slow * 100:+.1f} % "
            f"| {lo * 100:+.1f} % to {hi * 100:+.1f} % |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
