"""Layer-wise loads and the load-or-recompute decision through the Python API (the demo engine's
use of them is in test_demo.py; the per-layer fences in tests/cpp/test_layerwise.cpp)."""

from __future__ import annotations

import pytest

import hicache

torch = pytest.importorskip("torch")

B = 16
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _segments(device: str = "cpu", layers: int = 3, blocks: int = 8) -> list[torch.Tensor]:
    # K and V per layer, each layer's of another width, so a wrong segment range shows.
    return [
        torch.zeros(blocks, B, 4 * (layer + 1), device=device) for layer in range(layers) for _ in ("k", "v")
    ]


def _stored(segs: list[torch.Tensor], **kwargs: object) -> tuple[hicache.HostPrefixCache, list[int]]:
    cache = hicache.HostPrefixCache(segs, block_tokens=B, capacity_pages=8, admission="always", **kwargs)
    for s in segs:
        s[:2] = torch.randn(2, *s.shape[1:], device=s.device)
    prompt = list(range(2 * B + 1))
    assert cache.store("s", prompt, [0, 1, 2]) == 2
    if segs[0].is_cuda:
        torch.cuda.synchronize()
    cache.poll()
    return cache, prompt


def test_a_layerwise_load_brings_every_layer() -> None:
    segs = _segments()
    cache, prompt = _stored(segs, layers=3)
    load = cache.try_resume_layerwise("r", prompt, lambda n: [4, 5][: n // B])
    assert (load.tokens, load.layers) == (2 * B, 3)
    for i in range(3):
        load.wait(i)
        assert load.ready(i)
    load.synchronize()
    assert all(torch.equal(s[4:6], s[0:2]) for s in segs)
    assert cache.stats().layerwise_loads == 1
    miss = cache.try_resume_layerwise("m", [9] * 40, lambda n: [6, 7][: n // B])
    assert (miss.tokens, miss.layers) == (0, 0) and miss.ready(5)


def test_layers_are_checked_and_required() -> None:
    segs = _segments()
    with pytest.raises(ValueError, match=r"layers=4 does not split the 6 segments"):
        hicache.HostPrefixCache(segs, block_tokens=B, capacity_pages=8, layers=4)
    with pytest.raises(ValueError, match=r"add up to the 6 segments"):
        hicache.HostPrefixCache(segs, block_tokens=B, capacity_pages=8, layers=[2, 2, 1])
    with pytest.raises(TypeError, match="layers must be"):
        hicache.HostPrefixCache(segs, block_tokens=B, capacity_pages=8, layers="3")
    uneven = hicache.HostPrefixCache(segs, block_tokens=B, capacity_pages=8, layers=[1, 3, 2])
    assert uneven.layers == 3
    plain = hicache.HostPrefixCache(segs, block_tokens=B, capacity_pages=8)
    with pytest.raises(ValueError, match="needs the cache built with layers="):
        plain.try_resume_layerwise("r", list(range(40)), lambda n: [0, 1][: n // B])
    with pytest.raises(ValueError, match="at most one of prefill_tokens_per_s and prefill_seconds"):
        hicache.HostPrefixCache(
            segs, block_tokens=B, capacity_pages=8, prefill_tokens_per_s=1.0, prefill_seconds=lambda a, b: 0.0
        )
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be"):
        hicache.HostPrefixCache(segs, block_tokens=B, capacity_pages=8, prefill_tokens_per_s=0)


def test_a_hit_is_recomputed_when_the_engine_prefills_faster_than_it_loads() -> None:
    segs = _segments()
    asked: list[tuple[int, int]] = []
    speed = {"tokens_per_s": 1.0}  # slow at first: every hit is worth loading

    def prefill_seconds(start: int, end: int) -> float:
        asked.append((start, end))
        return (end - start) / speed["tokens_per_s"]

    cache, prompt = _stored(segs, prefill_seconds=prefill_seconds)
    assert cache.try_resume("a", prompt, lambda n: [4, 5][: n // B]) == 2 * B  # measures the rate
    assert asked == [] and cache.stats().load_bytes_per_s > 0
    assert cache.try_resume("b", prompt, lambda n: [4, 5][: n // B]) == 2 * B
    assert (0, 2 * B + 1) in asked and (2 * B, 2 * B + 1) in asked
    speed["tokens_per_s"] = 1e18  # now recomputing beats any copy
    assert cache.try_resume("c", prompt, lambda n: [4, 5][: n // B]) == 0
    s = cache.stats()
    assert (s.hits, s.hits_trimmed, s.pages_recomputed, s.pages_busy) == (2, 1, 2, 0)


def test_a_bad_prefill_model_is_named() -> None:
    segs = _segments()
    for bad, message in [
        (lambda start, end: -1.0, r"prefill_seconds\(32, 33\) must return a number of seconds >= 0"),
        (lambda start, end: "slow", r"prefill_seconds\(32, 33\) must return"),
        (lambda: 1.0, "prefill_seconds must take"),
    ]:
        cache, prompt = _stored(segs, prefill_seconds=bad)
        cache.try_resume("a", prompt, lambda n: [4, 5][: n // B])
        with pytest.raises((ValueError, TypeError), match=message):
            cache.try_resume("b", prompt, lambda n: [4, 5][: n // B])
        assert cache.stats().pages_busy == 0  # the pages the failed call held are free again


def _gpu_stored(
    chunk: int, blocks: int, **kwargs: object
) -> tuple[list[torch.Tensor], hicache.HostPrefixCache, list[int]]:
    """4 layers of K and V (8 uint8 segments of `chunk` bytes a block) on the GPU; blocks 0-3 of
    segment i hold i + 1 and are stored as the 4 pages of the returned prompt."""
    segs = [torch.zeros(blocks, B, chunk // B, device="cuda", dtype=torch.uint8) for _ in range(8)]
    cache = hicache.HostPrefixCache(segs, block_tokens=B, admission="always", layers=4, **kwargs)
    for i, s in enumerate(segs):
        s[:4] = i + 1
    prompt = list(range(4 * B + 1))
    assert cache.store("s", prompt, [0, 1, 2, 3, 4]) == 4
    torch.cuda.synchronize()
    cache.poll()
    return segs, cache, prompt


@needs_gpu
@pytest.mark.parametrize("chunk", [1 << 20, 32 << 10], ids=["dma-1MiB", "kernel-32KiB"])
def test_on_a_gpu_the_compute_stream_waits_for_each_layer_on_the_device(chunk: int) -> None:
    # Up to 64 MiB a layer: the copy stream is still busy when the engine asks for layer 0.
    # Chunks of 1 MiB cross on the DMA engines, 32 KiB ones through the kernel's layer table.
    segs, cache, prompt = _gpu_stored(chunk, 16, capacity_pages=8)
    copy = torch.cuda.Stream()
    load = cache.try_resume_layerwise("r", prompt, lambda n: [8, 9, 10, 11][: n // B], stream=copy)
    assert load.tokens == 4 * B and load.layers == 4
    sums = []
    for layer in range(4):
        load.wait(layer)  # the current stream waits; this thread does not
        sums.append([int(segs[2 * layer + j][8:12].sum(dtype=torch.int64)) for j in range(2)])
    torch.cuda.synchronize()
    expected = [[(2 * layer + j + 1) * 4 * chunk for j in range(2)] for layer in range(4)]
    assert sums == expected
    assert cache.stats().load_bytes_per_s > 1e9


@needs_gpu
def test_a_large_layerwise_load_submits_later_layers_as_the_engine_asks_for_them() -> None:
    # 4 layers of 256 MiB (4 pages x K, V x 32 MiB): try_resume submits layer 0 and 512 MiB after
    # it, so layer 3 crosses only once the engine asks for it; a load dropped before that never
    # writes layer 3 and releases its pages.
    chunk = 32 << 20
    segs, cache, prompt = _gpu_stored(chunk, 8, capacity_pages=4, pin_upfront=True)

    def sums(layer: int) -> list[int]:  # on the current stream
        return [int(segs[2 * layer + j][4:8].sum(dtype=torch.int64)) for j in range(2)]

    def stored(layer: int) -> list[int]:
        return [(2 * layer + j + 1) * 4 * chunk for j in range(2)]

    copy = torch.cuda.Stream()
    alloc = lambda n: [4, 5, 6, 7][: n // B]  # noqa: E731
    load = cache.try_resume_layerwise("r", prompt, alloc, stream=copy)
    assert load.tokens == 4 * B and load.layers == 4
    copy.synchronize()  # everything submitted so far has crossed
    assert [sums(layer) for layer in range(3)] == [stored(layer) for layer in range(3)]
    assert sums(3) == [0, 0], "layer 3 was submitted before the engine asked for it"
    cache.poll()
    assert cache.stats().pages_busy == 4
    load.wait(3)  # submits layer 3; the current stream waits for it
    assert sums(3) == stored(3)
    torch.cuda.synchronize()
    cache.poll()
    assert cache.stats().pages_busy == 0

    for s in segs:
        s[4:8] = 0
    torch.cuda.synchronize()
    load = cache.try_resume_layerwise("d", prompt, alloc, stream=copy)
    del load  # gives up layer 3
    copy.synchronize()
    cache.poll()
    assert cache.stats().pages_busy == 0
    assert sums(2) == stored(2) and sums(3) == [0, 0]


@needs_gpu
def test_a_small_load_is_not_queued_behind_a_large_one_on_another_stream() -> None:
    # The DMA engines run copies in submission order across streams: a small hit issued after a
    # 2 GiB one would wait for all of it. It goes around instead, and is in the engine's blocks
    # (byte for byte) while the large load is still crossing.
    segs = [torch.zeros(136, B, 1 << 16, device="cuda", dtype=torch.uint8) for _ in range(16)]  # 16 MiB pages
    cache = hicache.HostPrefixCache(
        segs, block_tokens=B, capacity_pages=136, admission="always", pin_upfront=True
    )
    for s in segs:
        s[:132].random_(0, 256)
    big, small = list(range(128 * B + 1)), list(range(10**6, 10**6 + 4 * B + 1))
    assert cache.store("big", big, list(range(129))) == 128
    assert cache.store("small", small, [128, 129, 130, 131, 132]) == 4
    torch.cuda.synchronize()
    cache.poll()
    s_big, s_small = torch.cuda.Stream(), torch.cuda.Stream()
    assert cache.try_resume("b", big, lambda n: [i % 128 for i in range(n // B)], stream=s_big) == 128 * B
    assert cache.try_resume("s", small, lambda n: [132, 133, 134, 135][: n // B], stream=s_small) == 4 * B
    s_small.synchronize()
    assert not s_big.query(), "the 2 GiB load ended before the small one: nothing to go around"
    assert all(torch.equal(s[132:136], s[128:132]) for s in segs)
    torch.cuda.synchronize()
