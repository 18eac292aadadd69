"""Replay a Mooncake-format trace through the real C++ index and policy, and through Belady.

A trace has one JSON request a line with ``input_length`` and ``hash_ids`` (one id per 512-token
block, chained: equal ids mean an equal prefix up to there). Each block becomes four 128-token
pages whose tokens are derived from the block id, so the real hash chain and exact matching run.
Requests look up their prompt (``try_resume``) and store it after "prefill" (write-through), with a
null copier: no bytes move and no memory is allocated. The offline optimum evicts the page whose
next use is farthest (Belady), and may decline to insert a page needed later than everything
cached; a descendant is never needed before its ancestor, and ties evict the deeper page first, so
the optimum never strands a page either.
"""

from __future__ import annotations

import heapq
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .cache import HostPrefixCache

BLOCK_TOKENS = 512  # Mooncake's hash granularity
PAGE_TOKENS = 128  # hicache's page
PAGES_PER_BLOCK = BLOCK_TOKENS // PAGE_TOKENS
MAX_HASH_ID = (2**31 // PAGE_TOKENS) // PAGES_PER_BLOCK - 1  # keeps every token id in int32


@dataclass
class Trace:
    name: str
    input_lengths: np.ndarray
    hash_ids: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.input_lengths)

    def pages(self, r: int) -> np.ndarray:
        """Page ids (hash_id * 4 + sub-page) of request r's full 128-token pages."""
        n = int(self.input_lengths[r]) // PAGE_TOKENS
        j = np.arange(n)
        return self.hash_ids[r][j // PAGES_PER_BLOCK] * PAGES_PER_BLOCK + j % PAGES_PER_BLOCK

    def prompt(self, r: int) -> np.ndarray:
        """The request's tokens: page p holds p*128 .. p*128+127, so equal pages mean equal tokens."""
        length = int(self.input_lengths[r])
        n = -(-length // PAGE_TOKENS)
        j = np.arange(n)
        page_ids = self.hash_ids[r][j // PAGES_PER_BLOCK] * PAGES_PER_BLOCK + j % PAGES_PER_BLOCK
        tokens = (page_ids[:, None] * PAGE_TOKENS + np.arange(PAGE_TOKENS)[None, :]).reshape(-1)
        return tokens[:length].astype(np.int32)


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Reads a Mooncake FAST'25 trace. Raises ValueError naming the line of a malformed request."""
    lengths: list[int] = []
    ids: list[np.ndarray] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(lengths) >= limit:
                break
            try:
                req = json.loads(line)
                length, hashes = int(req["input_length"]), req["hash_ids"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trace request ({e})") from e
            if length < 1 or not isinstance(hashes, list):
                raise ValueError(f"{path}:{lineno}: input_length must be >= 1 and hash_ids a list")
            need = -(-length // BLOCK_TOKENS)
            if len(hashes) < need:
                raise ValueError(f"{path}:{lineno}: {length} tokens need {need} hash_ids, got {len(hashes)}")
            arr = np.asarray(hashes[:need], dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() > MAX_HASH_ID):
                raise ValueError(f"{path}:{lineno}: hash ids must be in [0, {MAX_HASH_ID}]")
            lengths.append(length)
            ids.append(arr)
    if not lengths:
        raise ValueError(f"{path}: no requests")
    return Trace(Path(path).name, np.asarray(lengths, dtype=np.int64), ids)


@dataclass
class Result:
    policy: str
    capacity_tokens: int
    prompt_tokens: int
    hit_tokens: int
    second_half_prompt_tokens: int
    second_half_hit_tokens: int
    hits: int
    evictions: int
    seconds: float
    served: list[int] = field(default_factory=list, repr=False)
    unbounded: bool = False  # capacity "inf": room for every page of the trace

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def second_half_hit_ratio(self) -> float:
        return (
            self.second_half_hit_tokens / self.second_half_prompt_tokens
            if self.second_half_prompt_tokens
            else 0.0
        )

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        del d["served"]
        d["hit_ratio"] = round(self.hit_ratio, 6)
        d["second_half_hit_ratio"] = round(self.second_half_hit_ratio, 6)
        return d


def _result(
    policy: str,
    trace: Trace,
    capacity_pages: int,
    served: list[int],
    hits: int,
    evictions: int,
    seconds: float,
) -> Result:
    half = len(trace) // 2
    lengths = trace.input_lengths
    return Result(
        policy=policy,
        capacity_tokens=capacity_pages * PAGE_TOKENS,
        prompt_tokens=int(lengths.sum()),
        hit_tokens=int(sum(served)),
        second_half_prompt_tokens=int(lengths[half:].sum()),
        second_half_hit_tokens=int(sum(served[half:])),
        hits=hits,
        evictions=evictions,
        seconds=round(seconds, 3),
        served=served,
    )


Progress = Callable[[int, int], None]


def replay_cache(
    trace: Trace, capacity_pages: int, eviction: str, keep_tokens: int = 1, progress: Progress | None = None
) -> Result:
    """Runs every request through hicache's C++ index and policy (null copier)."""
    t0 = time.perf_counter()
    max_pages = max(int(n) for n in trace.input_lengths) // PAGE_TOKENS + 1
    blocks = np.arange(max_pages, dtype=np.int64)
    cache = HostPrefixCache(
        np.empty((max_pages, 1), np.uint8),
        block_tokens=PAGE_TOKENS,
        capacity_pages=capacity_pages,
        keep_tokens=keep_tokens,
        copier="null",
        eviction=eviction,
    )  # type: ignore[arg-type]
    served: list[int] = []
    for r in range(len(trace)):
        prompt = trace.prompt(r)
        got = cache.try_resume(r, prompt, lambda n: blocks[: n // PAGE_TOKENS])
        served.append(max(got, 0))
        cache.store(r, prompt, blocks)
        cache.forget(r)
        if progress is not None and (r % 500 == 0 or r == len(trace) - 1):
            progress(r + 1, len(trace))
    s = cache.stats()
    return _result(eviction, trace, capacity_pages, served, s.hits, s.pages_evicted, time.perf_counter() - t0)


def replay_optimum(
    trace: Trace, capacity_pages: int, keep_tokens: int = 1, progress: Progress | None = None
) -> Result:
    """Belady's offline optimum over the same page accesses and the same hit rule."""
    t0 = time.perf_counter()
    pages = [trace.pages(r) for r in range(len(trace))]
    never = math.inf
    # next_use[r][j]: the next request after r that uses page j of r.
    next_use: list[np.ndarray] = [np.empty(0)] * len(pages)
    last: dict[int, int] = {}
    for r in range(len(pages) - 1, -1, -1):
        nxt = np.fromiter((last.get(int(p), never) for p in pages[r]), dtype=float, count=len(pages[r]))
        next_use[r] = nxt
        for p in pages[r].tolist():
            last[p] = r
    cached: dict[int, tuple[float, int]] = {}  # page -> (next use, depth)
    heap: list[tuple[float, int, int]] = []  # (-next use, -depth, page): the top is evicted
    served: list[int] = []
    hits = evictions = 0
    for r, req in enumerate(pages):
        cap = max(0, int(trace.input_lengths[r]) - keep_tokens) // PAGE_TOKENS
        h = 0
        for p in req[:cap].tolist():
            if p not in cached:
                break
            h += 1
        served.append(h * PAGE_TOKENS)
        hits += h > 0
        for depth, (p, nu) in enumerate(zip(req.tolist(), next_use[r].tolist(), strict=True)):
            if p in cached:
                cached[p] = (nu, depth)
                heapq.heappush(heap, (-nu, -depth, p))
                continue
            if len(cached) >= capacity_pages:
                while True:  # the farthest valid entry
                    neg_nu, neg_depth, victim = heap[0]
                    if cached.get(victim) == (-neg_nu, -neg_depth):
                        break
                    heapq.heappop(heap)
                if (-neg_nu, -neg_depth) <= (nu, depth):
                    continue  # p is needed last of all: do not cache it
                heapq.heappop(heap)
                del cached[victim]
                evictions += 1
            cached[p] = (nu, depth)
            heapq.heappush(heap, (-nu, -depth, p))
        if progress is not None and (r % 500 == 0 or r == len(pages) - 1):
            progress(r + 1, len(pages))
    return _result("optimum", trace, capacity_pages, served, hits, evictions, time.perf_counter() - t0)


_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}
_BYTE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_capacity(text: str, page_bytes: int) -> int:
    """'3M' tokens, '64GiB' bytes (pages of page_bytes) or 'inf' -> capacity in pages."""
    t = text.strip().upper()
    if t in ("INF", "INFINITE"):
        return 2**62
    for unit in sorted(_BYTE_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            value = float(t[: -len(unit)]) * _BYTE_UNITS[unit]
            pages = int(value // page_bytes)
            break
    else:
        unit = t[-1] if t and t[-1] in _UNITS else ""
        try:
            value = float(t[: len(t) - len(unit)]) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"capacity {text!r}: use tokens (1M, 300K), bytes (64GiB) or inf") from None
        pages = int(value // PAGE_TOKENS)
    if pages < 1:
        raise ValueError(f"capacity {text!r} holds no 128-token page")
    return pages


def run(
    trace: Trace,
    capacities: Sequence[int],
    policies: Sequence[str],
    keep_tokens: int = 1,
    optimum: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[Result]:
    results = []
    all_pages = sum(int(n) // PAGE_TOKENS for n in trace.input_lengths)
    for requested in capacities:
        cap = min(requested, all_pages + 1)  # "inf": room for every page the trace holds
        for policy in [*policies, *(["optimum"] if optimum else [])]:

            def progress(done: int, total: int, policy: str = policy, cap: int = cap) -> None:
                if log is not None:
                    log(f"\r{trace.name}: {policy} at {cap * PAGE_TOKENS:,} tokens: {done}/{total}")

            if policy == "optimum":
                res = replay_optimum(trace, cap, keep_tokens, progress)
            else:
                res = replay_cache(trace, cap, policy, keep_tokens, progress)
            if log is not None:
                log("\n")
            res.unbounded = requested > all_pages
            results.append(res)
    return results


def format_table(trace: Trace, results: Sequence[Result]) -> str:
    best = {r.capacity_tokens: r.hit_tokens for r in results if r.policy == "optimum"}
    lines = [
        f"{trace.name}: {len(trace)} requests, {int(trace.input_lengths.sum()):,} prompt tokens",
        "",
        "| capacity (tokens) | policy | hit ratio | 2nd half | requests hit | evictions | of optimum "
        "| seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        cap = "inf" if r.unbounded else f"{r.capacity_tokens:,}"
        opt = best.get(r.capacity_tokens)
        of_opt = f"{r.hit_tokens / opt:.3f}" if opt else "-"
        lines.append(
            f"| {cap} | {r.policy} | {r.hit_ratio:.4f} | {r.second_half_hit_ratio:.4f} | {r.hits} | "
            f"{r.evictions} | {of_opt} | {r.seconds} |"
        )
    return "\n".join(lines)


def plot(results_by_trace: dict[str, list[Result]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from e
    fig, axes = plt.subplots(1, len(results_by_trace), figsize=(6 * len(results_by_trace), 4), squeeze=False)
    for ax, (name, results) in zip(axes[0], results_by_trace.items(), strict=True):
        finite = [r for r in results if not r.unbounded]
        for policy in dict.fromkeys(r.policy for r in finite):
            pts = sorted((r.capacity_tokens, r.hit_ratio) for r in finite if r.policy == policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("host capacity (tokens)")
        ax.set_ylabel("prompt tokens served from cache")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def log_stderr(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()
