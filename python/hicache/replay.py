"""Replay traces of prompts through hicache's index and policies, and through Belady's optimum.

A trace has one JSON request a line with ``input_length`` and ``hash_ids``: one id per
``block_tokens``-token block (512 in Mooncake's traces), chained, so equal ids mean an equal
prefix up to there. Ids may be any 64-bit integers. A trailing partial block may have an id or
not; tokens without one are unhashed: never stored, never served.

hicache keeps 128-token pages. A request's pages are the full pages its hashed blocks cover: a
512-token block is four pages (its id and a sub-page index); with blocks of 16, 32 or 64 tokens a
page is named by the id of the last block it ends (the ids are chained, so that id is the whole
prefix).

Each request runs as a lookup (``try_resume``, hit rule: ``keep_tokens`` always left to compute)
then a write-through store, through the real C++ ``PrefixIndex`` and ``AdmissionPolicy`` keyed by
page ids (hashing tokens would cost more than the policy; :func:`replay_cache` runs the engine
API itself and a test checks both agree). The offline optimum evicts the page used farthest in
the future and declines a page needed later than everything cached (Belady); ties evict the
deeper page first, so it never strands a page either.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import _core
from .cache import HostPrefixCache

PAGE_TOKENS = 128  # hicache's page
UNBOUNDED = 2**62  # capacity "inf", in pages
BLOCK_TOKENS = 512  # Mooncake's hash granularity (the default of --block-tokens)
U64 = 2**64

# --policy names: (eviction, admission)
POLICIES: dict[str, tuple[str, str]] = {
    "adaptive": ("leaf-first", "adaptive"),
    "second-sighting": ("leaf-first", "second-sighting"),
    "leaf-first": ("leaf-first", "always"),
    "lru": ("lru", "always"),
}


@dataclass
class Trace:
    name: str
    input_lengths: np.ndarray  # int64, tokens per request
    block_ids: np.ndarray  # uint64, per page of every request, in order
    sub_pages: np.ndarray  # uint32
    offsets: np.ndarray  # int64, len(requests) + 1: request r's pages are [offsets[r], offsets[r+1])
    block_tokens: int = BLOCK_TOKENS

    def __len__(self) -> int:
        return len(self.input_lengths)

    @property
    def pages_total(self) -> int:
        return int(self.offsets[-1])

    def page_count(self, r: int) -> int:
        return int(self.offsets[r + 1] - self.offsets[r])

    def pages(self, r: int) -> list[tuple[int, int]]:
        """Request r's pages as (block id, sub-page)."""
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        return list(zip(self.block_ids[a:b].tolist(), self.sub_pages[a:b].tolist(), strict=True))

    def hit_limit(self, keep_tokens: int) -> np.ndarray:
        """Pages a hit may cover per request: keep_tokens left to compute, hashed pages only."""
        cap = np.maximum(self.input_lengths - keep_tokens, 0) // PAGE_TOKENS
        return np.minimum(cap, np.diff(self.offsets)).astype(np.int64)


def _ids(hashes: object, where: str) -> np.ndarray:
    if not isinstance(hashes, list) or not all(type(h) is int for h in hashes):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    if any(h < -(2**63) or h >= U64 for h in hashes):
        raise ValueError(f"{where}: hash ids must be 64-bit integers (signed or unsigned)")
    return np.array([h % U64 for h in hashes], dtype=np.uint64)


def load_trace(path: str | Path, limit: int | None = None, block_tokens: int = BLOCK_TOKENS) -> Trace:
    """Reads a Mooncake-format trace. Raises ValueError naming the line of a malformed request."""
    if block_tokens < 1 or not (block_tokens % PAGE_TOKENS == 0 or PAGE_TOKENS % block_tokens == 0):
        raise ValueError(
            f"block_tokens={block_tokens}: must divide {PAGE_TOKENS} or be a multiple of it "
            "(16, 32, 64, 128, 256, 512, ...)"
        )
    lengths: list[int] = []
    ids: list[np.ndarray] = []
    subs: list[np.ndarray] = []
    counts: list[int] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(lengths) >= limit:
                break
            where = f"{path}:{lineno}"
            try:
                req = json.loads(line)
                length, hashes = req["input_length"], req["hash_ids"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{where}: not a trace request ({e})") from e
            if type(length) is not int or length < 1:
                raise ValueError(f"{where}: input_length must be an integer >= 1")
            arr = _ids(hashes, where)
            full = length // block_tokens
            if len(arr) < full:
                raise ValueError(
                    f"{where}: {length} tokens make {full} full {block_tokens}-token blocks; "
                    f"need {full} hash_ids, got {len(arr)}"
                )
            arr = arr[: -(-length // block_tokens)]  # ids past the prompt name nothing
            hashed = min(length, len(arr) * block_tokens)
            n = hashed // PAGE_TOKENS
            j = np.arange(n, dtype=np.int64)
            if block_tokens >= PAGE_TOKENS:
                per = block_tokens // PAGE_TOKENS
                block, sub = arr[j // per], (j % per).astype(np.uint32)
            else:
                per = PAGE_TOKENS // block_tokens
                block, sub = arr[(j + 1) * per - 1], np.zeros(n, np.uint32)
            lengths.append(length)
            ids.append(block)
            subs.append(sub)
            counts.append(n)
    if not lengths:
        raise ValueError(f"{path}: no requests")
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Trace(
        Path(path).name,
        np.asarray(lengths, dtype=np.int64),
        np.concatenate(ids) if ids else np.zeros(0, np.uint64),
        np.concatenate(subs) if subs else np.zeros(0, np.uint32),
        offsets,
        block_tokens,
    )


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
    pages_stored: int
    seconds: float
    pages_per_second: float = 0.0
    served: list[int] = field(default_factory=list, repr=False)
    unbounded: bool = False  # room for every page of the trace
    optimum_hit_tokens: int | None = None
    requested_tokens: int | None = None  # the capacity asked for, when larger than the trace

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def second_half_hit_ratio(self) -> float:
        s = self.second_half_prompt_tokens
        return self.second_half_hit_tokens / s if s else 0.0

    @property
    def of_optimum(self) -> float | None:
        o = self.optimum_hit_tokens
        return None if o is None else (self.hit_tokens / o if o else 1.0)

    def as_dict(self, page_bytes: int | None = None) -> dict[str, object]:
        d = asdict(self)
        del d["served"]
        d["hit_ratio"] = round(self.hit_ratio, 6)
        d["second_half_hit_ratio"] = round(self.second_half_hit_ratio, 6)
        d["of_optimum"] = None if self.of_optimum is None else round(self.of_optimum, 6)
        if page_bytes is not None:
            d["bytes_stored"] = self.pages_stored * page_bytes
        return d


def _result(
    policy: str, trace: Trace, capacity_pages: int, served_pages: Sequence[int], raw: dict, seconds: float
) -> Result:
    half = len(trace) // 2
    served = [int(s) * PAGE_TOKENS for s in served_pages]
    return Result(
        policy=policy,
        capacity_tokens=capacity_pages * PAGE_TOKENS,
        prompt_tokens=int(trace.input_lengths.sum()),
        hit_tokens=sum(served),
        second_half_prompt_tokens=int(trace.input_lengths[half:].sum()),
        second_half_hit_tokens=sum(served[half:]),
        hits=int(raw["requests_hit"]),
        evictions=int(raw["evictions"]),
        pages_stored=int(raw["pages_stored"]),
        seconds=round(seconds, 3),
        pages_per_second=round(trace.pages_total / seconds) if seconds > 0 else 0.0,
        served=served,
    )


def replay_policy(trace: Trace, capacity_pages: int, policy: str, keep_tokens: int = 1) -> Result:
    """One pass of a named policy (see POLICIES) through the C++ index, keyed by page ids."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
    eviction, admission = POLICIES[policy]
    t0 = time.perf_counter()
    raw = _core.replay_policy(
        trace.block_ids, trace.sub_pages, trace.offsets, trace.hit_limit(keep_tokens),
        capacity_pages, eviction, admission,
    )  # fmt: skip
    return _result(policy, trace, capacity_pages, raw["served_pages"], raw, time.perf_counter() - t0)


def replay_optimum(trace: Trace, capacity_pages: int, keep_tokens: int = 1) -> Result:
    """Belady's offline optimum over the same pages and the same hit rule."""
    t0 = time.perf_counter()
    raw = _core.replay_optimum(
        trace.block_ids, trace.sub_pages, trace.offsets, trace.hit_limit(keep_tokens), capacity_pages
    )
    return _result("optimum", trace, capacity_pages, raw["served_pages"], raw, time.perf_counter() - t0)


def replay_cache(trace: Trace, capacity_pages: int, policy: str, keep_tokens: int = 1) -> Result:
    """The same pass through the engine-facing API: HostPrefixCache with a null copier, tokens
    made from the page ids (hashing every page: slow, ~1 us a page). The check on
    :func:`replay_policy`: both must serve the same tokens to every request."""
    eviction, admission = POLICIES[policy]
    t0 = time.perf_counter()
    pairs = np.stack([trace.block_ids, trace.sub_pages.astype(np.uint64)], axis=1)
    _, dense = np.unique(pairs, axis=0, return_inverse=True)
    dense = dense.reshape(-1).astype(np.int64)
    if len(dense) and int(dense.max()) >= 2**31 // PAGE_TOKENS:
        raise ValueError("replay_cache: too many distinct pages for int32 tokens; use replay_policy")
    longest = int(trace.input_lengths.max()) // PAGE_TOKENS + 1
    blocks = np.arange(longest, dtype=np.int64)
    cache = HostPrefixCache(
        np.empty((longest, 1), np.uint8),
        block_tokens=PAGE_TOKENS,
        capacity_pages=capacity_pages,
        keep_tokens=keep_tokens,
        copier="null",
        eviction=eviction,  # type: ignore[arg-type]
        admission=admission,  # type: ignore[arg-type]
    )
    served: list[int] = []
    for r in range(len(trace)):
        a, b = int(trace.offsets[r]), int(trace.offsets[r + 1])
        hashed = (dense[a:b, None] * PAGE_TOKENS + np.arange(PAGE_TOKENS)[None, :]).reshape(-1)
        tail = np.full(int(trace.input_lengths[r]) - len(hashed), -1 - r)  # unhashed: unique
        prompt = np.concatenate([hashed, tail]).astype(np.int32)
        got = cache.try_resume(r, prompt, lambda n: blocks[: n // PAGE_TOKENS])
        served.append(max(got, 0) // PAGE_TOKENS)
        cache.store(r, prompt[: len(hashed)], blocks)
        cache.forget(r)
    s = cache.stats()
    raw = {"requests_hit": s.hits, "evictions": s.pages_evicted, "pages_stored": s.pages_stored}
    return _result(policy, trace, capacity_pages, served, raw, time.perf_counter() - t0)


ROUTES = ("affinity", "round-robin")


def route_requests(trace: Trace, instances: int, route: str) -> np.ndarray:
    """The instance each request runs on. ``round-robin``: request r on r mod N. ``affinity``: by
    the page that starts at token 512 (a conversation's turns share it, while page 0 is often a
    system prompt everyone shares), so one conversation stays on one instance."""
    if instances < 1:
        raise ValueError("instances must be >= 1")
    if route == "round-robin":
        return (np.arange(len(trace)) % instances).astype(np.int32)
    if route != "affinity":
        raise ValueError(f"route must be one of {', '.join(ROUTES)}, not {route!r}")
    counts = np.diff(trace.offsets)
    idx = trace.offsets[:-1] + np.minimum(4, np.maximum(counts - 1, 0))
    ids = np.where(counts > 0, trace.block_ids[np.minimum(idx, max(trace.pages_total - 1, 0))], 0)
    mixed = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(33)
    return (mixed % np.uint64(instances)).astype(np.int32)


TIER_WRITES = ("through", "back")


class _Shares:
    """Shares of a replay's prompt tokens."""

    prompt_tokens: int

    def ratio(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _tier_policy(policy: str, write: str) -> tuple[str, str]:
    """The host pool's (eviction, admission) for `policy`, once `write` is checked too."""
    if write not in TIER_WRITES:
        raise ValueError(f"write must be one of {', '.join(TIER_WRITES)}, not {write!r}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
    return POLICIES[policy]


@dataclass
class SharedResult(_Shares):
    instances: int
    route: str
    write: str
    host_capacity_tokens: int
    tier_capacity_tokens: int
    prompt_tokens: int
    private_hit_tokens: int  # N private host pools, no shared tier
    host_hit_tokens: int  # with the tier: served by the instance's own host pool
    tier_hit_tokens: int  # with the tier: served by the shared tier
    big_cache_hit_tokens: int  # one cache of N host pools plus the tier, serving every request
    tier_pages_stored: int
    seconds: float

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        for k in ("private", "host", "tier", "big_cache"):
            d[f"{k}_hit_ratio"] = round(self.ratio(getattr(self, f"{k}_hit_tokens")), 6)
        d["shared_hit_ratio"] = round(self.ratio(self.host_hit_tokens + self.tier_hit_tokens), 6)
        return d


def replay_shared(
    trace: Trace,
    instances: int,
    host_capacity_pages: int,
    tier_capacity_pages: int,
    route: str = "affinity",
    policy: str = "adaptive",
    keep_tokens: int = 1,
    write: str = "through",
) -> SharedResult:
    """N engine instances with private host pools, over one shared tier (written through, or
    back on eviction), beside N private pools alone and one big cache of all that memory. A host
    miss waits for the tier; a cache that prefetches instead serves what the private pools
    serve (the prompt's pages reach the host with its store either way)."""
    eviction, admission = _tier_policy(policy, write)
    t0 = time.perf_counter()
    where = route_requests(trace, instances, route)
    args = (trace.block_ids, trace.sub_pages, trace.offsets, trace.hit_limit(keep_tokens))
    private = _core.replay_shared(*args, where, instances, host_capacity_pages, 0, eviction, admission)
    shared = _core.replay_shared(
        *args, where, instances, host_capacity_pages, tier_capacity_pages, eviction, admission, write
    )
    big = _core.replay_policy(
        *args, instances * host_capacity_pages + tier_capacity_pages, eviction, admission
    )
    served, from_tier = sum(shared["served_pages"]), sum(shared["tier_pages"])
    return SharedResult(
        instances=instances,
        route=route,
        write=write,
        host_capacity_tokens=host_capacity_pages * PAGE_TOKENS,
        tier_capacity_tokens=tier_capacity_pages * PAGE_TOKENS,
        prompt_tokens=int(trace.input_lengths.sum()),
        private_hit_tokens=sum(private["served_pages"]) * PAGE_TOKENS,
        host_hit_tokens=(served - from_tier) * PAGE_TOKENS,
        tier_hit_tokens=from_tier * PAGE_TOKENS,
        big_cache_hit_tokens=sum(big["served_pages"]) * PAGE_TOKENS,
        tier_pages_stored=int(shared["tier_pages_stored"]),
        seconds=round(time.perf_counter() - t0, 3),
    )


@dataclass
class DiskResult(_Shares):
    write: str
    host_capacity_tokens: int
    disk_capacity_tokens: int
    prompt_tokens: int
    host_only_hit_tokens: int  # the host pool alone
    host_hit_tokens: int  # with the disk: served from host memory
    disk_hit_tokens: int  # with the disk: served from the disk
    disk_pages_written: int
    seconds: float

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        for k in ("host_only", "host", "disk"):
            d[f"{k}_hit_ratio"] = round(self.ratio(getattr(self, f"{k}_hit_tokens")), 6)
        d["total_hit_ratio"] = round(self.ratio(self.host_hit_tokens + self.disk_hit_tokens), 6)
        return d


def replay_disk(
    trace: Trace,
    host_capacity_pages: int,
    disk_capacity_pages: int,
    policy: str = "adaptive",
    keep_tokens: int = 1,
    write: str = "through",
) -> DiskResult:
    """One engine's host pool over a DiskTier of ``disk_capacity_pages`` (its own rule: the
    oldest segment out, a page read from the older half moved up), written through or back on
    eviction, beside the host pool alone. A host miss waits for the disk."""
    eviction, admission = _tier_policy(policy, write)
    t0 = time.perf_counter()
    one = np.zeros(len(trace), dtype=np.int32)
    args = (trace.block_ids, trace.sub_pages, trace.offsets, trace.hit_limit(keep_tokens), one, 1)
    alone = _core.replay_shared(*args, host_capacity_pages, 0, eviction, admission)
    both = _core.replay_shared(
        *args, host_capacity_pages, disk_capacity_pages, eviction, admission, write, "disk"
    )
    served, from_disk = sum(both["served_pages"]), sum(both["tier_pages"])
    return DiskResult(
        write=write,
        host_capacity_tokens=host_capacity_pages * PAGE_TOKENS,
        disk_capacity_tokens=disk_capacity_pages * PAGE_TOKENS,
        prompt_tokens=int(trace.input_lengths.sum()),
        host_only_hit_tokens=sum(alone["served_pages"]) * PAGE_TOKENS,
        host_hit_tokens=(served - from_disk) * PAGE_TOKENS,
        disk_hit_tokens=from_disk * PAGE_TOKENS,
        disk_pages_written=int(both["tier_pages_stored"]),
        seconds=round(time.perf_counter() - t0, 3),
    )


DISK_HEADER = (
    "| disk write | host pool (tokens) | disk (tokens) | host alone | with disk: host | with disk: disk "
    "| with disk: total | disk pages written | seconds |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def format_disk_row(r: DiskResult) -> str:
    total = r.host_hit_tokens + r.disk_hit_tokens
    return (
        f"| {r.write} | {r.host_capacity_tokens:,} | {r.disk_capacity_tokens:,} "
        f"| {r.ratio(r.host_only_hit_tokens):.4f} | {r.ratio(r.host_hit_tokens):.4f} "
        f"| {r.ratio(r.disk_hit_tokens):.4f} | {r.ratio(total):.4f} | {r.disk_pages_written:,} "
        f"| {r.seconds} |"
    )


SHARED_HEADER = (
    "| instances | route | tier write | host pool each (tokens) | shared tier (tokens) | private pools | "
    "shared: host | shared: tier | shared: total | one big cache | tier pages written | seconds |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def format_shared_row(r: SharedResult) -> str:
    total = r.host_hit_tokens + r.tier_hit_tokens
    return (
        f"| {r.instances} | {r.route} | {r.write} | {r.host_capacity_tokens:,} | {r.tier_capacity_tokens:,} "
        f"| {r.ratio(r.private_hit_tokens):.4f} | {r.ratio(r.host_hit_tokens):.4f} "
        f"| {r.ratio(r.tier_hit_tokens):.4f} | {r.ratio(total):.4f} | {r.ratio(r.big_cache_hit_tokens):.4f} "
        f"| {r.tier_pages_stored:,} | {r.seconds} |"
    )


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
        return UNBOUNDED
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
    jobs: int | None = None,
) -> Iterator[Result]:
    """Every (capacity, policy) pass, on `jobs` threads (default: every core); yields each
    result as it finishes, with its share of the optimum once the optimum at that capacity is
    known (the optimum of each capacity is started first)."""
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}: choose from {', '.join(POLICIES)}")
    if keep_tokens < 1:
        raise ValueError("keep_tokens must be >= 1 (the last token must be computed)")
    tasks: list[tuple[int, bool, str]] = []
    whole = False  # a pass with room for the whole trace is queued
    for requested in dict.fromkeys(capacities):  # a capacity given twice runs once
        cap = min(requested, trace.pages_total + 1)  # "inf": room for every page the trace holds
        unbounded = requested > trace.pages_total
        if unbounded and whole:
            continue  # the same pass as the first capacity that held the whole trace
        whole = whole or unbounded
        for policy in dict.fromkeys([*(["optimum"] if optimum else []), *policies]):
            tasks.append((cap, requested if unbounded else 0, policy))
    best: dict[int, int] = {}
    waiting: list[Result] = []  # finished before their optimum

    def one(cap: int, requested: int, policy: str) -> Result:
        res = (
            replay_optimum(trace, cap, keep_tokens)
            if policy == "optimum"
            else replay_policy(trace, cap, policy, keep_tokens)
        )
        res.unbounded = requested > 0
        if requested and requested < UNBOUNDED:
            res.requested_tokens = requested * PAGE_TOKENS
        return res

    workers = max(1, jobs or os.cpu_count() or 1)
    pool = ThreadPoolExecutor(max_workers=workers)  # the C++ passes release the GIL
    try:
        pending: set[Future[Result]] = {pool.submit(one, *t) for t in tasks}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                res = f.result()
                if res.policy == "optimum":
                    best[res.capacity_tokens] = res.hit_tokens
                    res.optimum_hit_tokens = res.hit_tokens
                    yield res
                    for w in [w for w in waiting if w.capacity_tokens == res.capacity_tokens]:
                        waiting.remove(w)
                        w.optimum_hit_tokens = res.hit_tokens
                        yield w
                elif optimum and res.capacity_tokens not in best:
                    waiting.append(res)
                else:
                    res.optimum_hit_tokens = best.get(res.capacity_tokens)
                    yield res
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


TABLE_HEADER = (
    "| capacity (tokens) | policy | hit ratio | 2nd half | of optimum | requests hit | evictions "
    "| pages stored | GB stored | seconds | pages/s |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def format_row(r: Result, page_bytes: int) -> str:
    cap = f"{r.capacity_tokens:,}"
    if r.unbounded:  # every page of the trace fits: say what was asked for
        cap = "inf" if r.requested_tokens is None else f"{r.requested_tokens:,} (> trace)"
    of_opt = "-" if r.of_optimum is None else f"{r.of_optimum:.3f}"
    return (
        f"| {cap} | {r.policy} | {r.hit_ratio:.4f} | {r.second_half_hit_ratio:.4f} | {of_opt} | {r.hits} "
        f"| {r.evictions} | {r.pages_stored:,} | {r.pages_stored * page_bytes / 1e9:,.0f} | {r.seconds} "
        f"| {r.pages_per_second / 1e6:.1f}M |"
    )


def format_table(trace: Trace, results: Sequence[Result], page_bytes: int = 16 << 20) -> str:
    order = {p: i for i, p in enumerate(["optimum", *POLICIES])}
    rows = sorted(results, key=lambda r: (r.unbounded, r.capacity_tokens, order.get(r.policy, 99)))
    head = f"{trace.name}: {len(trace)} requests, {int(trace.input_lengths.sum()):,} prompt tokens"
    return "\n".join([head, "", TABLE_HEADER, *(format_row(r, page_bytes) for r in rows)])


def check_plot_support() -> None:
    """--plot needs matplotlib: checked before any replay starts."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'hicache[plot]' (or matplotlib)") from e


def plot(results_by_trace: dict[str, list[Result]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


Log = Callable[[str], None]
