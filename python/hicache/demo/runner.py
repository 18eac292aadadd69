"""Runs the conversation workload with and without the cache and compares them."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from .engine import PagedEngine, RequestResult
from .workload import Conversation


def run_workload(
    engine: PagedEngine,
    conversations: list[Conversation],
    new_tokens: int,
    tag: str,
    progress: Callable[[str], None] | None = None,
) -> list[RequestResult]:
    """Turn by turn, conversation by conversation (so the cache must hold every conversation)."""
    history = [list(c.first) for c in conversations]
    turns = 1 + len(conversations[0].user_turns)
    results = []
    total = turns * len(conversations)
    shown = 0  # longest progress line so far: a shorter one is padded over it
    for t in range(turns):
        for i, conv in enumerate(conversations):
            prompt = history[i] if t == 0 else history[i] + conv.user_turns[t - 1]
            res = engine.run_request(f"{tag}-c{i}-t{t}", prompt, new_tokens)
            results.append(res)
            history[i] = prompt + res.generated  # the answer is part of the next prompt
            if progress is not None:
                line = f"{tag}: request {len(results)}/{total} ({len(prompt)} prompt tokens)"
                progress("\r" + line.ljust(shown))
                shown = max(shown, len(line))
    if progress is not None:
        progress("\n")
    return results


def run_restarted(
    make_engine: Callable[[], PagedEngine],
    conversations: list[Conversation],
    new_tokens: int,
    tag: str,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[RequestResult], list[dict[str, object]]]:
    """The workload round by round (a round: one turn of every conversation), each round on a
    fresh engine from `make_engine` (the process restarted: empty host memory) whose writes are
    flushed before it goes. Returns the results, in run_workload's order, and each round's cache
    counters."""
    history = [list(c.first) for c in conversations]
    turns = 1 + len(conversations[0].user_turns)
    by_round: list[list[RequestResult]] = []
    rounds: list[dict[str, object]] = []
    for t in range(turns):
        engine = make_engine()
        assert engine.cache is not None
        mine = []
        for i, conv in enumerate(conversations):
            prompt = history[i] if t == 0 else history[i] + conv.user_turns[t - 1]
            res = engine.run_request(f"{tag}-c{i}-t{t}", prompt, new_tokens)
            mine.append(res)
            history[i] = prompt + res.generated
        engine.cache.flush_tier()
        rounds.append(engine.cache.stats_dict())
        by_round.append(mine)
        if progress is not None:
            progress(f"\r{tag}: round {t + 1}/{turns} on a restarted engine")
        del engine
    if progress is not None:
        progress("\n")
    return [r for mine in by_round for r in mine], rounds


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


@dataclass
class Summary:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ttft_p50_with_ms: float
    ttft_p90_with_ms: float
    ttft_p50_without_ms: float
    ttft_p90_without_ms: float
    tokens_identical: bool
    mismatched_requests: int
    ideal_ratio_p50: float | None = None  # TTFT with cache / (suffix prefill + hit bytes at the DMA rate)
    # With a layer-wise run beside them (summarize's `layerwise`):
    ttft_p50_layerwise_ms: float | None = None
    ttft_p90_layerwise_ms: float | None = None
    layerwise_tokens_identical: bool | None = None
    # TTFT layer-wise / max(hit bytes at the DMA rate, suffix prefill), over requests with a hit
    overlap_ratio_p50: float | None = None
    overlap_ratio_p90: float | None = None
    # The engine thread's time inside try_resume_layerwise (the copies enqueued), over hits
    resume_call_p50_layerwise_ms: float | None = None


def summarize(
    with_cache: list[RequestResult],
    without: list[RequestResult],
    dma_bytes_per_s: float | None = None,
    layerwise: list[RequestResult] | None = None,
) -> Summary:
    """Compares a run with the cache (its loads timed apart: load_s) with one without, and
    optionally a layer-wise run of the same workload. The suffix prefill of a request is its TTFT
    with the cache minus its load; the ideal of a load-first engine is their sum, that of a
    layer-wise one their max (the load hidden behind compute, or the compute behind the load)."""
    mismatched = sum(a.generated != b.generated for a, b in zip(with_cache, without, strict=True))
    w = [r.ttft_s * 1e3 for r in with_cache]
    wo = [r.ttft_s * 1e3 for r in without]
    ideal = None
    if dma_bytes_per_s:
        ratios = [
            r.ttft_s / ((r.ttft_s - r.load_s) + r.hit_bytes / dma_bytes_per_s)
            for r in with_cache
            if r.cached_tokens > 0
        ]
        ideal = round(statistics.median(ratios), 3) if ratios else None
    s = Summary(
        requests=len(with_cache),
        prompt_tokens=sum(r.prompt_tokens for r in with_cache),
        cached_tokens=sum(r.cached_tokens for r in with_cache),
        ttft_p50_with_ms=round(_pct(w, 50), 2),
        ttft_p90_with_ms=round(_pct(w, 90), 2),
        ttft_p50_without_ms=round(_pct(wo, 50), 2),
        ttft_p90_without_ms=round(_pct(wo, 90), 2),
        tokens_identical=mismatched == 0,
        mismatched_requests=mismatched,
        ideal_ratio_p50=ideal,
    )
    if layerwise is not None:
        lw = [r.ttft_s * 1e3 for r in layerwise]
        s.ttft_p50_layerwise_ms = round(_pct(lw, 50), 2)
        s.ttft_p90_layerwise_ms = round(_pct(lw, 90), 2)
        s.layerwise_tokens_identical = all(
            a.generated == b.generated for a, b in zip(layerwise, without, strict=True)
        )
        calls = [r.resume_s * 1e3 for r in layerwise if r.loaded_tokens > 0]
        if calls:
            s.resume_call_p50_layerwise_ms = round(_pct(calls, 50), 2)
        if dma_bytes_per_s:
            overlap = [
                r.ttft_s / max(r.hit_bytes / dma_bytes_per_s, f.ttft_s - f.load_s)
                for r, f in zip(layerwise, with_cache, strict=True)
                if r.cached_tokens > 0 and r.cached_tokens == f.cached_tokens
            ]
            if overlap:
                s.overlap_ratio_p50 = round(_pct(overlap, 50), 3)
                s.overlap_ratio_p90 = round(_pct(overlap, 90), 3)
    return s
