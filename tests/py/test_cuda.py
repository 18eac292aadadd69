"""The CUDA path through the Python API, on torch CUDA tensors. Skipped without a GPU."""

from __future__ import annotations

import time

import pytest

import hicache
from conftest import assert_freed_by_refcount, requires_gpu, use_every_method

torch = pytest.importorskip("torch")
pytestmark = requires_gpu
B = 128


def random_(t: torch.Tensor) -> torch.Tensor:
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, device=t.device)
    t.copy_(raw.view(t.dtype).view(t.shape))
    return t


def pages(segments: list[torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    return [torch.cat([s[b].reshape(-1).view(torch.uint8) for s in segments]) for b in blocks]


@pytest.mark.parametrize(
    "make",
    [
        lambda: [torch.empty(64, 4, B, 2, 64, dtype=torch.bfloat16, device="cuda")],  # page-major
        lambda: [torch.empty(64, B, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(8)],
        lambda: list(torch.empty(2, 64, B, 4, 64, dtype=torch.float16, device="cuda").unbind(0)),
    ],
    ids=["page-major", "layer-major", "kv-views"],
)
# Paths: the automatic choice (layer-major's 2 MiB pages of 256 KiB chunks are staged, 4 pages a
# window; the others' 128 KiB pages take the kernel); staging windows smaller than a page (they
# widen to one page each); every path forced.
@pytest.mark.parametrize(
    "staging,path",
    [(16 << 20, "auto"), (1 << 20, "staged"), (16 << 20, "dma"), (16 << 20, "kernel"), (0, "auto")],
    ids=["auto", "staged-small-windows", "dma", "kernel", "no-staging"],
)
def test_random_bytes_round_trip_on_the_gpu(make, staging: int, path: str) -> None:
    segments = [random_(s) for s in make()]
    cache = hicache.HostPrefixCache(
        segments, block_tokens=B, capacity_pages=32, cuda_staging_bytes=staging, cuda_path=path
    )
    chunk = min(s[0].numel() * s.element_size() for s in segments)
    page = sum(s[0].numel() * s.element_size() for s in segments)
    few_large = len(segments) <= 2 and chunk >= 128 << 10 and page >= 256 << 10
    auto = (
        "dma"
        if chunk >= 1 << 20 or few_large
        else "staged"
        if staging > 0 and page >= 512 << 10
        else "kernel"
    )
    assert cache.copy_path == (path if path != "auto" else auto)
    prompt = torch.arange(10 * B + 5)
    before = pages(segments, list(range(10)))
    assert cache.store("a", prompt, list(range(11))) == 10
    torch.cuda.synchronize()
    cache.poll()
    for s in segments:
        s[20:].zero_()
    assert cache.try_resume("b", prompt, lambda n: list(range(20, 20 + n // B))) == 10 * B
    torch.cuda.synchronize()
    for a, b in zip(before, pages(segments, list(range(20, 30))), strict=True):
        assert torch.equal(a, b)
    assert not any(s[30:].view(torch.uint8).any() for s in segments)


def test_store_and_resume_on_a_side_stream_while_a_matmul_runs() -> None:
    segments = [random_(torch.empty(64, B, 8, 128, dtype=torch.bfloat16, device="cuda")) for _ in range(4)]
    cache = hicache.HostPrefixCache(segments, block_tokens=B, capacity_pages=32)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    before = pages(segments, list(range(8)))
    torch.cuda.synchronize()
    for _ in range(3):
        y = x @ x
    with torch.cuda.stream(side):  # the cache takes torch's current stream by default
        cache.store("a", torch.arange(8 * B + 1), list(range(9)))
    side.synchronize()
    cache.poll()
    for s in segments:
        s[32:40].zero_()
    torch.cuda.synchronize()
    for _ in range(3):
        y = x @ x  # noqa: F841
    assert cache.try_resume("b", torch.arange(8 * B + 1), lambda n: list(range(32, 40)), stream=side) == 8 * B
    side.synchronize()
    for a, b in zip(before, pages(segments, list(range(32, 40))), strict=True):
        assert torch.equal(a, b)
    torch.cuda.synchronize()


@pytest.mark.parametrize("path", ["dma", "staged", "kernel"])
def test_stores_and_loads_from_four_threads_at_once_move_exact_bytes(path: str) -> None:
    # Two threads store new prompts and two load cached ones, each on its own stream, as an
    # engine's write and load threads do, on every path (each stream its own staging lane).
    # Every load must bring its prompt's bytes, and every store must keep them.
    import threading

    segments = [random_(torch.empty(256, 16 << 10, dtype=torch.uint8, device="cuda")) for _ in range(4)]
    cache = hicache.HostPrefixCache(
        segments, block_tokens=16, capacity_pages=512, cuda_path=path, admission="always"
    )
    assert cache.copy_path == path
    n = 8  # pages a prompt

    def prompt(k: int) -> torch.Tensor:
        return torch.arange(n * 16 + 1, dtype=torch.int32) + k * 1_000_000

    def sources(k: int) -> list[int]:  # blocks 0-127 hold the engine's KV; nothing writes there
        return [(k * 5 + 3 * i) % 128 for i in range(n)]

    cached = list(range(8))
    for k in cached:
        assert cache.store(f"c{k}", prompt(k), sources(k)) == n
    torch.cuda.synchronize()
    cache.poll()
    failures: list[str] = []

    def writer(w: int) -> None:
        s = torch.cuda.Stream()
        for i in range(24):
            k = 100 + 100 * w + i
            if cache.store(f"w{k}", prompt(k), sources(k), stream=s) != n:
                failures.append(f"store {k}: {cache.stats().last_error}")
            s.synchronize()
            cache.forget(f"w{k}")

    def reader(r: int) -> None:
        s = torch.cuda.Stream()
        targets = list(range(128 + 64 * r, 128 + 64 * r + n))
        for i in range(24):
            k = cached[(i + r) % len(cached)]
            got = cache.try_resume(f"r{r}", prompt(k), lambda t: targets[: t // 16], stream=s)
            s.synchronize()
            cache.forget(f"r{r}")
            if got != n * 16:
                failures.append(f"load {k}: {got} tokens")
                continue
            for a, b in zip(pages(segments, sources(k)), pages(segments, targets), strict=True):
                if not torch.equal(a, b):
                    failures.append(f"load {k} by reader {r}: wrong bytes")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    torch.cuda.synchronize()
    cache.poll()
    targets = list(range(200, 200 + n))
    for w in range(2):
        for i in range(24):
            k = 100 + 100 * w + i
            assert cache.try_resume("check", prompt(k), lambda t: targets[: t // 16]) == n * 16
            torch.cuda.synchronize()
            cache.forget("check")
            for a, b in zip(pages(segments, sources(k)), pages(segments, targets), strict=True):
                assert torch.equal(a, b), f"stored prompt {k}"
    assert cache.stats().pages_busy == 0


def test_pages_in_flight_are_neither_hit_nor_evicted() -> None:
    seg = random_(torch.empty(16, B, 1024, dtype=torch.float16, device="cuda"))
    cache = hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=2)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # the copy queues behind ~0.1 s of spinning
        assert cache.store("a", torch.arange(2 * B + 1), [0, 1, 2]) == 2
        assert cache.try_resume("x", torch.arange(2 * B + 1), lambda n: [8, 9]) == 0
        assert cache.store("b", torch.arange(2 * B + 1) + 7, [3, 4, 5]) == 0
    assert cache.stats().pages_busy == 2
    s.synchronize()
    assert cache.poll() == 1
    assert cache.try_resume("y", torch.arange(2 * B + 1), lambda n: [8, 9], stream=s) == 2 * B
    s.synchronize()
    u8 = seg.view(torch.uint8)  # random bytes hold NaNs: compare bits, not values
    assert torch.equal(u8[8], u8[0]) and torch.equal(u8[9], u8[1])


def test_state_through_a_cuda_staging_tensor() -> None:
    seg = torch.zeros(16, B, 64, dtype=torch.bfloat16, device="cuda")
    cache = hicache.HostPrefixCache(
        seg, block_tokens=B, capacity_pages=8, state_bytes=8192, capacity_states=2
    )
    staging = torch.empty(4096, dtype=torch.bfloat16, device="cuda")
    want = torch.randn(4096, device="cuda").to(torch.bfloat16)

    def export(pos: int) -> torch.Tensor | None:
        if pos != 2 * B:
            return None
        staging.copy_(want)
        return staging

    cache.store("a", torch.arange(2 * B + 9), [0, 1, 2], state_export=export)
    torch.cuda.synchronize()
    staging.zero_()
    assert cache.try_resume("b", torch.arange(2 * B + 9), lambda n: [5, 6], state_out=staging) == 2 * B
    torch.cuda.synchronize()
    assert torch.equal(staging, want)
    with pytest.raises(ValueError, match="state_out must be 8192 bytes on cuda:0"):
        cache.try_resume(
            "c", torch.arange(2 * B + 9), lambda n: [5, 6], state_out=torch.empty(4096, dtype=torch.bfloat16)
        )


def test_cuda_segments_must_share_one_device_and_blocks_are_checked() -> None:
    seg = torch.zeros(8, B, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="segment 1 is on cpu"):
        hicache.HostPrefixCache([seg, torch.zeros(8, B, 64)], block_tokens=B, capacity_pages=4)
    cache = hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=4)
    with pytest.raises(IndexError, match="block id 8"):
        cache.store("a", torch.arange(B + 1), [8])


def test_a_dropped_cuda_cache_is_freed_at_once() -> None:
    segments = [torch.zeros(8, B, 512, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    state = torch.zeros(1024, device="cuda")
    assert_freed_by_refcount(lambda: use_every_method(segments, state))


def test_a_pool_of_several_chunks_is_pinned_within_seconds_and_stores_are_not_cut() -> None:
    # Default options; a Llama-3-8B-shaped pool (64 x 256 KiB, 16 MiB pages) of 256 pages: four
    # 1 GiB chunks. Grown one chunk per burst of stores (the old behaviour), the pool never grew
    # without traffic and cut stores of more than a chunk short for seconds; pinned ahead of
    # demand, it becomes whole by itself (0.4-0.5 s on an H200), after which no store of 80 new
    # pages (1.25 GiB, more than a chunk) is cut short.
    segs = [torch.zeros(81, 256 << 10, dtype=torch.uint8, device="cuda") for _ in range(64)]
    t0 = time.perf_counter()
    cache = hicache.HostPrefixCache(segs, block_tokens=B, capacity_pages=256)
    full = 256 * (16 << 20)
    growth = []
    while cache.stats().host_bytes < full and time.perf_counter() - t0 < 10:
        growth.append((round(time.perf_counter() - t0, 2), cache.stats().host_bytes >> 20))
        time.sleep(0.05)
    whole_at = time.perf_counter() - t0
    print(f"\npool of {full >> 20} MiB whole after {whole_at:.2f} s; (s, pinned MiB):", growth[::4])
    assert cache.stats().host_bytes == full, (growth, cache.stats().pinning, cache.stats().pinning_note)
    assert (cache.stats().pinning, cache.stats().pinning_note) == ("whole", "")
    stored = []
    for round_ in range(8):
        prompt = torch.arange(80 * B + 1) + round_ * 10**6
        stored.append(cache.store(f"w{round_}", prompt, list(range(81))))
        torch.cuda.synchronize()
        cache.poll()
        cache.forget(f"w{round_}")
        time.sleep(0.1)
    assert stored == [80] * 8, stored
    assert cache.stats().store_skips_unpinned == 0


def test_a_store_that_outruns_the_pinning_is_cut_counted_and_the_pool_still_becomes_whole() -> None:
    # Two chunks of 4 GiB of 1 MiB pages: the constructor pins the first, the sweep the second
    # (~0.2 s at 20-30 GB/s); a store of more than the first, sent at once, reaches the second
    # chunk within milliseconds, before it can be there, and is cut there, counted.
    seg = torch.zeros(4097, 1 << 20, dtype=torch.uint8, device="cuda")
    cache = hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=8192, pool_chunk_bytes=4 << 30)
    prompt = torch.arange(4097 * B + 1)
    assert cache.stats().host_bytes == 4 << 30
    assert cache.store("w", prompt, list(range(4097))) == 4096
    s = cache.stats()
    assert (s.store_skips_unpinned, s.store_skips) == (1, 0)
    deadline = time.perf_counter() + 10
    while cache.stats().pinning != "whole" and time.perf_counter() < deadline:
        time.sleep(0.05)
    s = cache.stats()
    assert (s.pinning, s.host_bytes, s.host_bytes_capacity) == ("whole", 8 << 30, 8 << 30), s.pinning_note
    torch.cuda.synchronize()
    cache.poll()
    assert cache.stats().pages_stored == 4096


def test_a_gpu_cache_restarted_over_a_disk_tier_loads_exactly_what_it_stored(tmp_path) -> None:
    # Pinned host slots of 2 MiB pages are aligned to 4096, so the disk's direct I/O writes each
    # page from its pinned slot and reads it back into one, with no copy through the tier's own
    # buffer (pinned memory takes direct I/O); after a restart the GPU blocks get the same bytes.
    kv_a = [random_(torch.empty(16, B, 8, 128, dtype=torch.bfloat16, device="cuda")) for _ in range(4)]
    prompt = torch.arange(6 * B + 5, dtype=torch.int32)
    tier = hicache.DiskTier(tmp_path / "disk", 256 << 20)
    a = hicache.HostPrefixCache(kv_a, block_tokens=B, capacity_pages=16, tier=tier)
    assert a.store("a", prompt, list(range(7))) == 6
    torch.cuda.synchronize()
    a.flush_tier()
    assert a.stats().tier_pages_written == 6
    assert tier.stats()["values_written_direct"] == 6, tier.stats()
    del a, tier  # the engine restarts
    tier = hicache.DiskTier(tmp_path / "disk", 256 << 20)
    kv_b = [torch.zeros_like(t) for t in kv_a]
    b = hicache.HostPrefixCache(kv_b, block_tokens=B, capacity_pages=16, tier=tier, tier_wait_ms=10_000)
    target = list(range(10, 16))
    assert b.try_resume("b", prompt, lambda n: target[: n // B]) == 6 * B
    torch.cuda.synchronize()
    assert all(
        torch.equal(x, y) for x, y in zip(pages(kv_a, list(range(6))), pages(kv_b, target), strict=True)
    )
    s = tier.stats()
    assert (s["values_read"], s["values_read_direct"], s["read_failures"]) == (6, 6, 0), s


@pytest.mark.parametrize("busy", [False, True], ids=["idle-stream", "busy-stream"])
@pytest.mark.parametrize("damage", [False, True], ids=["intact", "page-2-damaged"])
def test_a_gpu_caches_load_checks_fetched_pages_and_ends_before_a_damaged_one(
    damage: bool, busy: bool
) -> None:
    # The CUDA copier does not sum pages on the CPU: a GPU cache's load checks the pages it
    # fetched from the tier either on the device, where they landed (the stream had nothing
    # queued before the load, so the call waits for the load), or on the page threads beside
    # the copy (work was queued: the call never waits for the engine's stream). A flipped byte
    # in page 2's value ends the hit before page 2 (pages 0-1 exact, one page rejected) either
    # way; the control, intact, serves all six (and with work queued returns before it ends).
    tier = hicache.MemoryTier()
    kv_a = [random_(torch.empty(16, B, 8, 128, dtype=torch.bfloat16, device="cuda")) for _ in range(4)]
    kv_b = [torch.zeros_like(t) for t in kv_a]
    a = hicache.HostPrefixCache(kv_a, block_tokens=B, capacity_pages=16, tier=tier)
    prompt = torch.arange(6 * B + 5, dtype=torch.int32)
    assert a.store("a", prompt, list(range(7))) == 6
    torch.cuda.synchronize()
    a.flush_tier()
    assert len(tier) == 6
    if damage:  # the value that starts with page 2's bytes
        want = pages(kv_a, [2])[0].cpu().numpy().tobytes()
        name = next(n for n in tier.names() if tier.value(n)[: len(want)] == want)
        value = bytearray(tier.value(name))
        value[len(want) // 2] ^= 0x10
        assert tier.set_value(name, bytes(value))
    b = hicache.HostPrefixCache(kv_b, block_tokens=B, capacity_pages=16, tier=tier, tier_wait_ms=1000)
    target = list(range(10, 16))
    good = 2 if damage else 6
    torch.cuda.synchronize()
    if busy:
        torch.cuda._sleep(200_000_000)  # the load queues behind ~0.1 s of spinning
    assert b.try_resume("b", prompt, lambda n: target[: n // B]) == good * B
    # It waited for the load where it summed on the device (idle), or where a page failed: that
    # page's slot is freed only once the load still reading it has ended.
    assert torch.cuda.current_stream().query() == (not busy or damage)
    torch.cuda.synchronize()
    assert all(
        torch.equal(x, y)
        for x, y in zip(pages(kv_a, list(range(good))), pages(kv_b, target[:good]), strict=True)
    )
    s = b.stats()
    assert (s.tier_pages_fetched, s.tier_pages_rejected) == (6, 1 if damage else 0), s
    assert s.tier_pages_checked_on_device == (0 if busy else 6), s


@pytest.mark.parametrize("wait_ms", [1000.0, 0.0], ids=["wait", "prefetch"])
def test_a_shared_tier_serves_a_gpu_cache_what_another_one_stored(wait_ms: float) -> None:
    # Two engine "hosts" on one GPU with their own pinned pools share an in-memory tier: the
    # second loads into its GPU blocks exactly what the first stored, having never seen it.
    tier = hicache.MemoryTier()
    kv_a = [random_(torch.empty(16, B, 8, 128, dtype=torch.bfloat16, device="cuda")) for _ in range(4)]
    kv_b = [torch.zeros_like(t) for t in kv_a]
    a = hicache.HostPrefixCache(kv_a, block_tokens=B, capacity_pages=16, tier=tier)
    b = hicache.HostPrefixCache(kv_b, block_tokens=B, capacity_pages=16, tier=tier, tier_wait_ms=wait_ms)
    prompt = torch.arange(6 * B + 5, dtype=torch.int32)
    assert a.store("a", prompt, list(range(7))) == 6
    torch.cuda.synchronize()
    a.flush_tier()
    assert a.stats().tier_pages_written == 6 and len(tier) == 6
    target = list(range(10, 16))
    got = b.try_resume("b", prompt, lambda n: target[: n // B])
    if wait_ms == 0:  # prefetch: a host miss now, served from host memory next time
        assert got == 0
        b.flush_tier()
        got = b.try_resume("b2", prompt, lambda n: target[: n // B])
    torch.cuda.synchronize()
    assert got == 6 * B
    assert all(
        torch.equal(x, y) for x, y in zip(pages(kv_a, list(range(6))), pages(kv_b, target), strict=True)
    )
    assert b.stats().tier_pages_fetched == 6 and b.stats().tier_pages_rejected == 0
