"""Pages loaded back are bit-identical to the pages stored (invariant 6), on torch and numpy."""

import numpy as np
import pytest

import hicache
from conftest import assert_freed_by_refcount, use_every_method

torch = pytest.importorskip("torch")
B = 16


def random_fill(t: "torch.Tensor", gen: "torch.Generator") -> None:
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.copy_(raw.view(t.dtype).view(t.shape))


def run_round_trip(segments: list["torch.Tensor"]) -> None:
    gen = torch.Generator().manual_seed(0)
    for s in segments:
        random_fill(s, gen)
    cache = hicache.HostPrefixCache(segments, block_tokens=B, capacity_pages=16)
    assert cache.copy_path == "cpu"
    prompt = torch.arange(5 * B + 1)
    stored = [[s[b].clone() for s in segments] for b in range(5)]
    assert cache.store("a", prompt, torch.arange(6)) == 5
    cache.poll()
    for s in segments:
        s[8:].zero_()
    assert cache.try_resume("b", prompt, lambda n: torch.arange(8, 8 + n // B)) == 5 * B
    for i in range(5):
        for s, before in zip(segments, stored[i], strict=True):
            assert torch.equal(s[8 + i].view(torch.uint8), before.view(torch.uint8))
    # Blocks not handed out are untouched.
    for s in segments:
        assert not s[13:].view(torch.uint8).any()


def test_page_major_bf16_pool_round_trips_exactly() -> None:
    run_round_trip([torch.empty(16, 4, B, 2, 32, dtype=torch.bfloat16)])  # [blocks, layers, B, kv, dim]


def test_layer_major_four_segments_round_trip_exactly() -> None:
    run_round_trip([torch.empty(16, B, 8, 16, dtype=torch.bfloat16) for _ in range(4)])


def test_kv_views_of_one_tensor_with_block_stride_round_trip() -> None:
    # vLLM-style per-layer [2, num_blocks, ...]: K and V are views with their own base pointers.
    kv = torch.empty(2, 16, B, 64, dtype=torch.float16)
    run_round_trip([kv[0], kv[1]])


def test_mixed_dtypes_and_a_strided_block_dimension() -> None:
    big = torch.empty(16, 2, B, 8, dtype=torch.float32)
    run_round_trip([big[:, 0], torch.empty(16, 24, dtype=torch.int8)])


def test_numpy_segments_round_trip() -> None:
    seg = np.random.default_rng(0).integers(0, 255, size=(8, B, 10), dtype=np.uint8)
    cache = hicache.HostPrefixCache([seg], block_tokens=B, capacity_pages=4)
    before = seg[:2].copy()
    cache.store(1, list(range(2 * B + 1)), [0, 1, 2])
    seg[4:] = 0
    assert cache.try_resume(2, list(range(2 * B + 1)), lambda n: [4, 5]) == 2 * B
    assert np.array_equal(seg[4:6], before)


def test_host_bytes_sizes_the_pool_in_whole_pages() -> None:
    seg = torch.empty(8, B, 64, dtype=torch.float16)  # 2048 bytes a page
    cache = hicache.HostPrefixCache(seg, block_tokens=B, host_bytes=2048 * 3 + 100)
    assert cache.page_bytes == 2048
    assert cache.stats().pages_capacity == 3
    assert cache.stats().host_bytes == 0  # lazy: nothing allocated before the first store
    cache.store("a", torch.arange(B + 1), [0, 1])
    assert cache.stats().host_bytes > 0


def test_a_dropped_cache_is_freed_at_once() -> None:
    segments = [torch.zeros(8, B, 4), torch.zeros(8, B, 4)]
    assert_freed_by_refcount(lambda: use_every_method(segments, torch.zeros(16)))
