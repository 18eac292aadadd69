"""Layer-wise loads on a GPU, through the public API: convoys and the load-or-recompute decision.

    python bench/layerwise.py convoy [--big-tokens 100000 --small-tokens 1024]
    python bench/layerwise.py decide [--model small --context 8192 --competitors 0,4,16]

convoy: a Llama-3-8B-shaped layer-major pool (32 layers x K, V of 128 tokens x 8 heads x 128,
bf16: 64 segments of 256 KiB a block). A 1K-token hit is loaded alone, then right after a
100K-token hit was issued on another stream (loaded first, or layer by layer), and its latency
(the call until its stream is done, the call's own CPU time included) is compared.

decide: the demo engine with a model whose prefill is fast for its KV (the `small` preset),
while N other streams copy host memory to the GPU (a throttled link). Per request, the time to
first token of an engine that always loads its hit, of one that never does (no cache), and of
one that tells the cache its prefill rate (the cache then loads or recomputes).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

import hicache

B = 128


def _pool(blocks: int) -> list[torch.Tensor]:
    return [torch.zeros(blocks, B, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(64)]


def convoy(args: argparse.Namespace) -> None:
    for path in args.paths.split(","):
        _convoy(path, args)
        torch.cuda.empty_cache()


def _convoy(path: str, args: argparse.Namespace) -> None:
    big_pages, small_pages = args.big_tokens // B, args.small_tokens // B
    n = big_pages + 2 * small_pages + 2
    segs = _pool(n)
    cache = hicache.HostPrefixCache(
        segs, block_tokens=B, capacity_pages=big_pages + small_pages + 1, admission="always",
        layers=32, cuda_path=path,
    )  # fmt: skip
    for s in segs:
        s.normal_()
    big = torch.randint(0, 30000, (big_pages * B + 1,)).tolist()
    small = torch.randint(30000, 60000, (small_pages * B + 1,)).tolist()
    while cache.stats().host_bytes < (big_pages + small_pages) * cache.page_bytes:
        time.sleep(0.05)  # the pool is pinned in the background
    cache.store("big", big, list(range(big_pages + 1)))
    cache.store("small", small, list(range(big_pages + 1, big_pages + small_pages + 2)))
    torch.cuda.synchronize()
    cache.poll()
    s_big, s_small = torch.cuda.Stream(), torch.cuda.Stream()
    big_to = list(range(n - big_pages - small_pages, n - small_pages))
    small_to = list(range(n - small_pages, n))
    rid = iter(range(10**9))

    def load_small() -> float:
        t0 = time.perf_counter()
        got = cache.try_resume(f"s{next(rid)}", small, lambda k: small_to[: k // B], stream=s_small)
        s_small.synchronize()
        assert got == small_pages * B
        return time.perf_counter() - t0

    loads = []

    def issue_big(layerwise: bool) -> float:
        t0 = time.perf_counter()
        if layerwise:
            load = cache.try_resume_layerwise(f"b{next(rid)}", big, lambda k: big_to[: k // B], stream=s_big)
            # The worst case: an engine whose thread ran ahead and asked for the last layer at
            # once, so every layer is queued (asking submits the layers not yet submitted).
            load.ready(load.layers - 1)
            loads.append(load)  # dropped, its layers not yet submitted would be given up
            got = load.tokens
        else:
            got = cache.try_resume(f"b{next(rid)}", big, lambda k: big_to[: k // B], stream=s_big)
        assert got == big_pages * B
        return time.perf_counter() - t0

    def settle() -> None:
        torch.cuda.synchronize()
        loads.clear()
        cache.poll()

    alone = []
    for _ in range(args.reps):
        alone.append(load_small())
        settle()
    big_alone = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        issue_big(False)
        s_big.synchronize()
        big_alone.append(time.perf_counter() - t0)
        settle()
    rows = []
    for layerwise in (False, True):
        beside, big_left = [], []
        for _ in range(args.reps):
            issue_big(layerwise)
            beside.append(load_small())
            big_left.append(not s_big.query())
            settle()
        rows.append((layerwise, min(beside), statistics.median(beside), sum(big_left)))
    a = min(alone)
    gb = big_pages * cache.page_bytes / 1e9
    print(
        f"\n{path} ({cache.copy_path}): 1K-token load alone {a * 1e3:.2f} ms; "
        f"{args.big_tokens}-token load alone {min(big_alone) * 1e3:.1f} ms ({gb / min(big_alone):.1f} GB/s)"
    )
    print("| big load issued | small load beside it, best / median (ms) | / alone | big still running |")
    print("| --- | --- | --- | --- |")
    for layerwise, best, med, left in rows:
        kind = "layer by layer" if layerwise else "whole"
        print(f"| {kind} | {best * 1e3:.2f} / {med * 1e3:.2f} | {med / a:.2f} | {left}/{args.reps} |")


class Competitor:
    """`streams` streams copying 256 MiB host buffers to the GPU, back to back, until stopped."""

    def __init__(self, streams: int) -> None:
        self.streams = [torch.cuda.Stream() for _ in range(streams)]
        self.src = [torch.empty(256 << 20, dtype=torch.uint8).pin_memory() for _ in range(streams)]
        self.dst = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(streams)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for s, src, dst in zip(self.streams, self.src, self.dst, strict=True):
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)
            self.streams[-1].synchronize()  # at most one copy queued a stream

    def __enter__(self) -> Competitor:
        if self.streams:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.streams:
            self.thread.join()
        torch.cuda.synchronize()


def decide(args: argparse.Namespace) -> None:
    from hicache.demo import PRESETS, PagedEngine, TinyTransformer

    dev = torch.device("cuda")
    model = TinyTransformer(PRESETS[args.model], dev, torch.bfloat16, seed=0)
    vocab = model.cfg.vocab
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (args.context,), generator=g).tolist()

    def suffix() -> list[int]:
        return torch.randint(0, vocab, (args.suffix,), generator=g).tolist()

    blocks = (args.context + args.suffix + 16) // B + 4
    kw = {"num_blocks": blocks, "block_tokens": B, "prefill_chunk": args.chunk}
    plain = PagedEngine(model, **kw)
    for _ in range(3):  # warm-up, then the engine's own prefill rate at this length
        plain.run_request("w", context + suffix(), 1)
    full = statistics.median(plain.run_request("w", context + suffix(), 1).ttft_s for _ in range(3))
    rate = (args.context + args.suffix) / full
    print(
        f"\n{args.model} model, {args.context}-token cached context + {args.suffix}-token suffix, "
        f"prefill {rate:,.0f} tokens/s ({full * 1e3:.1f} ms for the whole prompt)"
    )
    engines = {
        "always load": PagedEngine(model, cache_pages=blocks, **kw),
        "decides": PagedEngine(model, cache_pages=blocks, prefill_tokens_per_s=rate, **kw),
    }
    page_mb = engines["decides"].page_bytes / 2**20
    for e in engines.values():
        e.run_request("ctx", context + suffix(), 1)  # stores the context
        e.run_request("m", context + suffix(), 1)  # a first hit measures the link
    print(f"hit: {args.context // B} pages of {page_mb:.2f} MiB")
    print("| competing streams | never load (ms) | always load (ms) | decides (ms) | loaded / declined |")
    print("| --- | --- | --- | --- | --- |")
    for comp in [int(c) for c in args.competitors.split(",")]:
        with Competitor(comp):
            time.sleep(0.2)
            never = [plain.run_request("n", context + suffix(), 1).ttft_s for _ in range(args.reps)]
            always = [
                engines["always load"].run_request("a", context + suffix(), 1).ttft_s
                for _ in range(args.reps)
            ]
            before = engines["decides"].cache.stats()
            runs = [engines["decides"].run_request("d", context + suffix(), 1) for _ in range(args.reps)]
            after = engines["decides"].cache.stats()
        loaded = after.hits - before.hits
        declined = after.hits_trimmed - before.hits_trimmed
        med = statistics.median
        print(
            f"| {comp} | {med(never) * 1e3:.1f} | {med(always) * 1e3:.1f} | "
            f"{med(r.ttft_s for r in runs) * 1e3:.1f} | {loaded} / {declined} "
            f"(rate {after.load_bytes_per_s / 1e9:.1f} GB/s) |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("convoy")
    c.add_argument("--big-tokens", type=int, default=100_096)
    c.add_argument("--small-tokens", type=int, default=1024)
    c.add_argument("--paths", default="auto,dma")
    c.add_argument("--reps", type=int, default=5)
    c.set_defaults(func=convoy)
    d = sub.add_parser("decide")
    d.add_argument("--model", default="small")
    d.add_argument("--context", type=int, default=8192)
    d.add_argument("--suffix", type=int, default=256)
    d.add_argument("--chunk", type=int, default=2048)
    d.add_argument("--competitors", default="0,2,8,32")
    d.add_argument("--reps", type=int, default=5)
    d.set_defaults(func=decide)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
