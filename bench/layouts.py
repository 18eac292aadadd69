"""Every KV layout through the public API: hicache's stores and loads against contiguous copies.

For each layout of a grid (bytes per block per segment x segment counts, pages of at most
64 MiB), a ``hicache.HostPrefixCache`` with default options (``--paths`` can force each copy
path too) stores and loads a batch of pages on a side stream, and one contiguous torch copy of
the same bytes between pinned host memory and the GPU runs in the same process, back to back.
Every time is wall time from before the call until its stream is done, so the call's own CPU
time counts; each is the best of ``--reps``. Printed per point: the path, the store and load
ratios (contiguous time / hicache time), and the both-at-once ratio (a store on one stream and a
load on another, against two contiguous copies on two streams). ``--cpu-cost`` instead times the
CPU part of single calls (until they return) for several batch sizes. ``--mover`` also times the
split API's copy half (``SlotMover``) moving the same pages between shuffled slots and blocks: no
hashing, no index, only the copy path (the one ``--paths`` forced, if it did), i.e. that path's
own limit at the point.

Engine blocks and host slots are both shuffled, as in a cache that has run for a while.
``--in-order`` gives the other end: each call's engine blocks consecutive, and the pool full of
earlier prompts stored the same way, so a store takes the slots of an old chain (freed leaf
first) and a load the slots its prompt was stored in: runs of pages whose slots and blocks both
follow each other, which the DMA path copies as one piece.

    python bench/layouts.py                        # the grid, default options
    python bench/layouts.py --paths dma,staged,kernel --pages 1024
    python bench/layouts.py --cpu-cost
    python bench/layouts.py --mover --no-both     # the one-call API beside its copy half
    python bench/layouts.py --engines --paths auto,dma   # engines' pools: 16-64-token blocks
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import hicache

B = 128  # tokens per block in the grid: only the hash chain sees them
# Engines' own pools (--engines): the block sizes vLLM and SGLang use (16, 32, 64 tokens) for
# four model shapes, bf16, one segment per layer and K/V tensor as vLLM and SGLang's MHA pools
# lay them out (MLA: one latent tensor a layer). name: (layers x K/V tensors, bytes a token in one
# tensor).
ENGINE_SHAPES = {
    "Llama-3-8B": (32 * 2, 8 * 128 * 2),  # 8 KV heads of 128
    "Llama-3-70B, TP8": (80 * 2, 1 * 128 * 2),  # 8 KV heads over 8 ranks
    "DeepSeek-V3 MLA": (61, 576 * 2),  # kv_lora_rank 512 + rope 64
    "gpt-oss-120b": (36 * 2, 8 * 64 * 2),  # 64-dim heads, 8 KV heads
}
ENGINE_BLOCKS = [16, 32, 64]
KIB = 1024
CHUNKS_KIB = [16, 32, 64, 128, 144, 256, 512, 1024, 4096, 16384]
SEGMENTS = [1, 2, 32, 61, 64, 96, 128]
MAX_PAGE = 64 << 20
DEVICE = "cuda"  # --device cpu runs the same code on the CPU copier (to check the script)


def stream() -> Any:
    return torch.cuda.Stream() if DEVICE == "cuda" else None


def on(s: Any) -> Any:
    return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()


def host_buffer(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    return t.pin_memory() if DEVICE == "cuda" else t


def best_wall(fn: Callable[[], Any], wait: Callable[[], None], tidy: Callable[[], None], reps: int) -> float:
    """Seconds, best of reps: fn() and everything it enqueued (until wait() returns). tidy()
    runs between the timed runs."""
    best = float("inf")
    for _ in range(reps):
        tidy()
        t0 = time.perf_counter()
        fn()
        wait()
        best = min(best, time.perf_counter() - t0)
    tidy()
    return best


class Failed(Exception):
    """A path could not store or load a batch (the cache says why)."""


class Point:
    """One layout: segments on the GPU, a cache over them, a cached prompt to load."""

    def __init__(
        self,
        chunk: int,
        nseg: int,
        pages: int,
        path: str,
        capacity: int = 4,
        staging: int | None = None,
        tokens: int = B,
        in_order: bool = False,
    ) -> None:
        self.chunk, self.nseg, self.pages, self.tokens = chunk, nseg, pages, tokens
        self.page_bytes = chunk * nseg
        blocks = 2 * pages + 1
        self.segs = [torch.empty(blocks, chunk, dtype=torch.uint8, device=DEVICE) for _ in range(nseg)]
        for s in self.segs:
            s.random_(0, 255)
        self.cache = hicache.HostPrefixCache(
            self.segs,
            block_tokens=tokens,
            capacity_pages=capacity * pages,
            cuda_path=path,
            **({} if staging is None else {"cuda_staging_bytes": staging}),
            admission="always",  # every store copies: this measures copies, not the policy
        )
        self.path = self.cache.copy_path
        self.path_asked = path
        self.pool_bytes = capacity * pages * ((self.page_bytes + 255) // 256 * 256)
        t0 = time.perf_counter()
        while DEVICE == "cuda" and self.cache.stats().host_bytes < self.pool_bytes:
            if time.perf_counter() - t0 > 60:
                sys.exit(f"the pool was not pinned after 60 s: {self.cache.stats_dict()}")
            time.sleep(0.01)
        self.pin_s = time.perf_counter() - t0
        rng = random.Random(chunk * 131 + nseg)
        order = list(range(blocks))
        if not in_order:
            rng.shuffle(order)
        self.sources, self.targets = order[:pages], order[pages : 2 * pages]
        self.s1, self.s2 = stream(), stream()
        self.n = 0
        self.ready: torch.Tensor | None = None  # the next fresh() prompt
        self.done: list[str] = []  # requests to forget once their copies completed
        # Host slots in random order, as in a cache that has run for a while: fill the pool with
        # one-page prompts, touch them in a random order (a store of a cached page copies
        # nothing), so the measured prompts evict them, and take their slots, in that order.
        # With in_order, instead: prompts of `pages` pages over the same blocks, in order.
        singles = (
            []
            if in_order
            else [torch.tensor([i] * tokens + [0], dtype=torch.int32) for i in range(capacity * pages)]
        )
        for _ in range(capacity if in_order else 0):
            self.store(self.prompt(), self.s1)
            self.sync()
        for i, one in enumerate(singles):
            self.cache.store("fill", one, [self.sources[i % pages]], stream=self.s1)
        self.sync()
        rng.shuffle(singles)
        for one in singles:
            self.cache.store("fill", one, [0])
        if singles:
            self.done.append("fill")
        self.cached = self.prompt()
        self.store(self.cached, self.s1)
        self.sync()

    def prompt(self) -> torch.Tensor:
        self.n += 1
        return torch.arange(self.pages * self.tokens + 1, dtype=torch.int32) + self.n * 10_000_000

    def fresh(self) -> torch.Tensor:
        """A prompt no page holds, made before the timed call (sync() prepares the next one): a
        131K-token prompt takes ~0.3 ms to make on an H200 host, which is not hicache's time."""
        ready, self.ready = self.ready, None
        return ready if ready is not None else self.prompt()

    def wait(self) -> None:
        if self.s1 is not None:
            self.s1.synchronize()
            self.s2.synchronize()

    def sync(self) -> None:
        """Waits, retires, forgets finished requests and keeps the loaded prompt the most
        recently used (so measured stores never evict it)."""
        self.wait()
        self.cache.poll()
        for rid in self.done:  # forgetting a store still in flight would discard it
            self.cache.forget(rid)
        self.done.clear()
        if hasattr(self, "cached"):
            self.cache.store("touch", self.cached, self.targets)  # cached: copies nothing
            self.cache.forget("touch")
        if self.ready is None:
            self.ready = self.prompt()

    def store(self, prompt: torch.Tensor, stream: Any) -> None:
        got = self.cache.store(f"w{self.n}", prompt, self.sources, stream=stream)
        if got != self.pages:
            raise Failed(f"stored {got} of {self.pages} pages: {self.cache.stats().last_error}")
        self.done.append(f"w{self.n}")

    def load(self, stream: Any) -> None:
        t = self.tokens
        got = self.cache.try_resume("r", self.cached, lambda n: self.targets[: n // t], stream=stream)
        if got != self.pages * t:
            s = self.cache.stats()
            raise Failed(f"loaded {got} tokens of {self.pages * t}: errors {s.errors}, {s.last_error}")
        self.done.append("r")

    def measure(self, reps: int, both: bool = True) -> dict[str, float]:
        nbytes = self.pages * self.page_bytes
        pinned = host_buffer(nbytes)
        pinned2 = host_buffer(nbytes)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
        dev2 = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)

        def h2d() -> None:
            with on(self.s1):
                dev.copy_(pinned, non_blocking=True)

        def d2h() -> None:
            with on(self.s2):
                pinned2.copy_(dev2, non_blocking=True)

        def both_copies() -> None:
            h2d()
            d2h()

        def store() -> None:
            self.store(self.fresh(), self.s1)

        def both_hicache() -> None:
            self.store(self.fresh(), self.s1)
            self.load(self.s2)

        w, t = self.wait, self.sync
        r = {
            "h2d_s": best_wall(h2d, w, t, reps),
            "d2h_s": best_wall(d2h, w, t, reps),
            "load_s": best_wall(lambda: self.load(self.s1), w, t, reps),
            "store_s": best_wall(store, w, t, reps),
        }
        # The calls' own CPU time (until they return), best of reps, per page.
        for name, call in (("load", lambda: self.load(self.s1)), ("store", store)):
            ret = float("inf")
            for _ in range(reps):
                self.sync()
                t0 = time.perf_counter()
                call()
                ret = min(ret, time.perf_counter() - t0)
            self.sync()
            r[f"{name}_call_us_a_page"] = ret / self.pages * 1e6
        r["load"] = r["h2d_s"] / r["load_s"]
        r["store"] = r["d2h_s"] / r["store_s"]
        # The wall-time target: at most 1.05 x the contiguous copy + 100 us (>= 1: met).
        r["load_target"] = (1.05 * r["h2d_s"] + 1e-4) / r["load_s"]
        r["store_target"] = (1.05 * r["d2h_s"] + 1e-4) / r["store_s"]
        r["both"] = float("nan")
        if both:
            r["both_s"] = best_wall(both_copies, w, t, reps)
            r["both_hicache_s"] = best_wall(both_hicache, w, t, reps)
            r["both"] = r["both_s"] / r["both_hicache_s"]
        r["gbps_contiguous_h2d"] = nbytes / r["h2d_s"] / 1e9
        return r

    def measure_mover(self, reps: int, r: dict[str, float]) -> None:
        """The split API's copy half over the same segments: the same pages between shuffled
        host slots and engine blocks, with no hashing and no index (the copy path's own limit)."""
        nslots = 2 * self.pages
        mover = hicache._core.SlotMover(
            self.segs, nslots, "auto", None, False, 1 << 30, cuda_path=self.path_asked
        )
        order = random.Random(self.chunk + self.nseg).sample(range(nslots), nslots)
        slots, others = torch.tensor(order[: self.pages]), torch.tensor(order[self.pages :])
        src, dst = torch.tensor(self.sources), torch.tensor(self.targets)
        one = self.s1.cuda_stream if self.s1 is not None else 0
        two = self.s2.cuda_stream if self.s2 is not None else 0

        def tidy() -> None:
            self.wait()
            mover.finished()

        def both() -> None:  # a store on one stream, a load of other slots on the other
            mover.submit(True, slots, src, one)
            mover.submit(False, others, dst, two)

        r["mover_store_s"] = best_wall(lambda: mover.submit(True, slots, src, one), self.wait, tidy, reps)
        r["mover_load_s"] = best_wall(lambda: mover.submit(False, slots, dst, one), self.wait, tidy, reps)
        r["mover_store"] = r["d2h_s"] / r["mover_store_s"]
        r["mover_load"] = r["h2d_s"] / r["mover_load_s"]
        r["mover_both"] = float("nan")
        if "both_s" in r:
            r["mover_both"] = r["both_s"] / best_wall(both, self.wait, tidy, reps)
        self.mover_path = mover.copy_path


def grid(chunks: list[int], segments: list[int]) -> list[tuple[int, int]]:
    return [(c * KIB, n) for c in chunks for n in segments if c * KIB * n <= MAX_PAGE]


def pages_for(page_bytes: int, wanted: int, max_batch: int) -> int:
    return max(16, min(wanted, max_batch // page_bytes))


def run_grid(args: argparse.Namespace) -> None:
    points = grid(args.chunks, args.segments)
    print(
        f"# {len(points)} layouts x pages {args.pages} x paths {args.paths}; batches of at most "
        f"{args.max_batch >> 20} MiB; best of {args.reps}; "
        f"{'slots and blocks in order' if args.in_order else 'slots and blocks shuffled'}; "
        f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}",
        flush=True,
    )
    mover = " SlotMover: path, store, load, both |" if args.mover else ""
    print(
        "| chunk | segments | page | pages | path | store | load | both | store, load vs 1.05x+100us "
        f"| contiguous GB/s | pinned in |{mover}"
    )
    print("| --- " * (11 + bool(args.mover)) + "|", flush=True)
    results = []
    for chunk, nseg in points:
        for wanted in args.pages:
            pages = pages_for(chunk * nseg, wanted, args.max_batch)
            for path, mib in [(pa, m) for pa in args.paths for m in (args.staging_mib or [None])]:
                try:
                    staging = None if mib is None else mib << 20
                    p = Point(chunk, nseg, pages, path, capacity=2, staging=staging, in_order=args.in_order)
                    r = p.measure(args.reps, both=not args.no_both)
                    if args.mover:
                        p.measure_mover(args.reps, r)
                except Failed as e:
                    print(f"| {chunk // KIB} KiB | {nseg} | | {pages} | {path} | failed: {e} |", flush=True)
                    continue
                label = p.path if len(args.staging_mib) <= 1 else f"{p.path}, {mib} MiB staging"
                row = dict(chunk=chunk, segments=nseg, page=chunk * nseg, pages=pages, path=label, **r)
                results.append(row)
                if args.json:  # after every point: an interrupted sweep keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(results, f, indent=1)
                page = f"{chunk * nseg / 2**20:.2f} MiB"
                moved = (
                    f" {p.mover_path}, {r['mover_store']:.3f}, {r['mover_load']:.3f}, {r['mover_both']:.3f} |"
                    if args.mover
                    else ""
                )
                print(
                    f"| {chunk // KIB} KiB | {nseg} | {page} | {pages} | {label} | {r['store']:.3f} | "
                    f"{r['load']:.3f} | {r['both']:.3f} | {r['store_target']:.2f}, {r['load_target']:.2f} "
                    f"| {r['gbps_contiguous_h2d']:.1f} | {p.pin_s:.2f} s |{moved}",
                    flush=True,
                )
                del p
                torch.cuda.empty_cache()


def engine_points(blocks: list[int] | None = None) -> list[tuple[str, int, int, int]]:
    """(model, block tokens, chunk bytes, segments) of every engine pool of --engines (of these
    block sizes only, if given)."""
    return [
        (model, tokens, tokens * per_token, nseg)
        for model, (nseg, per_token) in ENGINE_SHAPES.items()
        for tokens in ENGINE_BLOCKS
        if not blocks or tokens in blocks
    ]


def run_engines(args: argparse.Namespace) -> None:
    """Engines' own pools (ENGINE_SHAPES x ENGINE_BLOCKS) through the one-call API and its copy
    half, with each call's CPU time a page."""
    print(
        f"# engines' pools x paths {args.paths} x staging {args.staging_mib or 'default'} MiB; "
        f"{args.pages[0]} pages a call (at most {args.max_batch >> 20} MiB); best of {args.reps}; "
        f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}",
        flush=True,
    )
    print(
        "| model | block tokens | segments x chunk | page | pages | path | store | load | both at once "
        "| CPU us a page: store / load call | SlotMover store / load / both at once |"
    )
    print("| --- " * 11 + "|", flush=True)
    results = []
    for model, tokens, chunk, nseg in engine_points(args.blocks):
        pages = pages_for(chunk * nseg, args.pages[0], args.max_batch)
        for path, mib in [(pa, m) for pa in args.paths for m in (args.staging_mib or [None])]:
            try:
                staging = None if mib is None else mib << 20
                p = Point(chunk, nseg, pages, path, capacity=2, staging=staging, tokens=tokens)
                r = p.measure(args.reps, both=not args.no_both)
                p.measure_mover(args.reps, r)
            except Failed as e:
                print(f"| {model} | {tokens} | {nseg} x {chunk} | | {pages} | {path} | failed: {e} |")
                continue
            label = p.path if len(args.staging_mib) <= 1 else f"{p.path}, {mib} MiB staging"
            row = dict(model=model, tokens=tokens, chunk=chunk, segments=nseg, page=chunk * nseg,
                       pages=pages, path=label, **r)  # fmt: skip
            results.append(row)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
            size, page = f"{chunk / KIB:g} KiB", f"{chunk * nseg / 2**20:.2f} MiB"
            print(
                f"| {model} | {tokens} | {nseg} x {size} | {page} | {pages} | {label} "
                f"| {r['store']:.3f} | {r['load']:.3f} | {r['both']:.3f} | {r['store_call_us_a_page']:.2f} / "
                f"{r['load_call_us_a_page']:.2f} | {r['mover_store']:.3f} / {r['mover_load']:.3f} / "
                f"{r['mover_both']:.3f} |",
                flush=True,
            )
            del p
            torch.cuda.empty_cache()


def run_cpu_cost(args: argparse.Namespace) -> None:
    """CPU time of single calls (until they return) and their wall time to completion."""
    print("| layout | pages | load call returns | load done | store call returns | store done |")
    print("| --- | --- | --- | --- | --- | --- |")
    for chunk, nseg, label in [(64 * KIB, 64, "64 x 64 KiB"), (32 * KIB, 48, "48 x 32 KiB")]:
        for pages in (16, 160, 1600):
            p = Point(chunk, nseg, pages, "auto", capacity=2)
            out = {}
            calls = (("load", lambda p=p: p.load(p.s1)), ("store", lambda p=p: p.store(p.fresh(), p.s1)))
            for name, fn in calls:
                ret, done = float("inf"), float("inf")
                for _ in range(args.reps):
                    p.sync()
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    p.wait()
                    ret, done = min(ret, t1 - t0), min(done, time.perf_counter() - t0)
                p.sync()
                out[name] = (ret, done)
            (lr, ld), (sr, sd) = out["load"], out["store"]
            print(
                f"| {label} ({p.path}) | {pages} | {lr * 1e3:.2f} ms | {ld * 1e3:.2f} ms "
                f"| {sr * 1e3:.2f} ms | {sd * 1e3:.2f} ms |",
                flush=True,
            )
            del p
            torch.cuda.empty_cache()


def report(path: str) -> None:
    """The table BENCHMARKS.md shows, from a --json file (no GPU needed): ratios below the
    targets in bold (0.95 a direction, 0.90 both at once), then the counts. The SlotMover column
    and counts need a --mover run: "not run" otherwise."""

    def mark(v: float, target: float) -> str:
        return f"**{v:.3f}**" if v < target else f"{v:.3f}"

    rows = json.load(open(path))
    print(
        "| chunk | segments | page | pages a call | path | store | load | both at once | store, load time "
        "vs 1.05 x contiguous + 100 us | SlotMover store / load / both at once |"
    )
    print("| --- " * 10 + "|")
    for r in rows:
        chunk = f"{r['chunk'] >> 20} MiB" if r["chunk"] >= 1 << 20 else f"{r['chunk'] // KIB} KiB"
        mover = (
            " / ".join(
                mark(r[f"mover_{k}"], 0.90 if k == "both" else 0.95) for k in ("store", "load", "both")
            )
            if "mover_store" in r
            else "not run"
        )
        print(
            f"| {chunk} | {r['segments']} | {r['page'] / 2**20:.2f} MiB | {r['pages']} | {r['path']} | "
            f"{mark(r['store'], 0.95)} | {mark(r['load'], 0.95)} | {mark(r['both'], 0.90)} | "
            f"{r['store_target']:.2f}, {r['load_target']:.2f} | {mover} |"
        )
    big = [r for r in rows if r["page"] >= 4 << 20]
    movers = [r for r in rows if "mover_store" in r]
    mover = (
        f"SlotMover ({len(movers)} points): {sum(r['mover_store'] >= 0.95 for r in movers)} / "
        f"{sum(r['mover_load'] >= 0.95 for r in movers)} / {sum(r['mover_both'] >= 0.90 for r in movers)}"
        if movers
        else "SlotMover: not run"
    )
    print(
        f"\n{len(rows)} points: store >= 0.95 on {sum(r['store'] >= 0.95 for r in rows)}, load >= 0.95 on "
        f"{sum(r['load'] >= 0.95 for r in rows)}, both at once >= 0.90 on "
        f"{sum(r['both'] >= 0.90 for r in rows)}, the wall-time target in both directions on "
        f"{sum(r['store_target'] >= 1 and r['load_target'] >= 1 for r in rows)}. {mover}. "
        f"Pages of 4 MiB and more ({len(big)} points): store "
        f"on {sum(r['store'] >= 0.95 for r in big)}, load on {sum(r['load'] >= 0.95 for r in big)}, the "
        f"lowest {min(r['store'] for r in big):.3f} / {min(r['load'] for r in big):.3f}."
    )


def plot(path: str, png: str) -> None:
    """The grid of a --json file as a figure: the ratio to the link against the page size, one
    panel per direction, 16-page calls and the largest calls apart, the targets as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.load(open(path))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), sharey=True)
    panels = (("store", "store (GPU to host)", 0.95), ("load", "load (host to GPU)", 0.95),
              ("both", "both at once", 0.90))  # fmt: skip
    small = min(r["pages"] for r in rows)
    for ax, (key, title, target) in zip(axes, panels, strict=True):
        for calls, marker in ((True, "o"), (False, "^")):
            pts = [r for r in rows if (r["pages"] == small) == calls]
            for seg_class, color in (
                ((1, 2), "tab:red"),
                ((32, 61, 64), "tab:blue"),
                ((96, 128), "tab:green"),
            ):
                sel = [r for r in pts if r["segments"] in seg_class]
                if not sel:
                    continue
                size = "16 pages" if calls else "up to 1 GiB"
                label = f"{'/'.join(map(str, seg_class))} segments, {size} a call"
                ax.scatter([r["page"] / 2**20 for r in sel], [r[key] for r in sel], marker=marker, s=22,
                           color=color, alpha=0.75, label=label)  # fmt: skip
        ax.axhline(target, color="black", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel("page (MiB)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hicache / contiguous copy of the same bytes")
    axes[0].set_ylim(0, 1.1)
    axes[2].legend(fontsize=7, loc="lower right")
    fig.suptitle("Every KV layout through the public API (one H200, default options); dashed: the target")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=ints, default=CHUNKS_KIB, help="KiB per block per segment")
    ap.add_argument("--segments", type=ints, default=SEGMENTS)
    ap.add_argument("--pages", type=ints, default=[1024], help="pages per call (capped by --max-batch)")
    ap.add_argument("--max-batch", type=int, default=1 << 30, help="bytes per call at most")
    ap.add_argument("--paths", type=lambda s: s.split(","), default=["auto"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--staging-mib", type=ints, default=[], help="cuda_staging_bytes values, MiB (default: the library's)"
    )
    ap.add_argument("--json", default="", help="also write every result here, as it comes")
    ap.add_argument("--no-both", action="store_true", help="skip the both-directions-at-once runs")
    ap.add_argument("--cpu-cost", action="store_true")
    ap.add_argument("--engines", action="store_true", help="engines' pools (16-64-token blocks), no grid")
    ap.add_argument("--blocks", type=ints, default=[], help="with --engines: these block sizes only (tokens)")
    ap.add_argument("--mover", action="store_true", help="also time SlotMover's copy of the same pages")
    ap.add_argument(
        "--in-order",
        action="store_true",
        help="consecutive blocks and a pool of prompts stored so, not shuffled ones (the grid only)",
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--report", default="", help="print BENCHMARKS.md's table from a --json file, and stop")
    ap.add_argument("--plot", default="", help="with --report: also draw the grid into this PNG (matplotlib)")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return plot(args.report, args.plot) if args.plot else None
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and (not torch.cuda.is_available() or not hicache.cuda_available()):
        sys.exit("needs a CUDA GPU and a CUDA build of hicache (or --device cpu)")
    if args.cpu_cost:
        run_cpu_cost(args)
    elif args.engines:
        run_engines(args)
    else:
        run_grid(args)


if __name__ == "__main__":
    main()
