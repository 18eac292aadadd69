"""Bad input raises a clear Python exception before anything is copied (invariant 3)."""

import numpy as np
import pytest

import hicache

torch = pytest.importorskip("torch")
B = 16


@pytest.fixture
def setup() -> tuple[hicache.HostPrefixCache, "torch.Tensor"]:
    seg = torch.zeros(8, B, 4, dtype=torch.float16)
    cache = hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=8)
    seg[:3] = 1.0
    cache.store("a", torch.arange(2 * B + 1), [0, 1, 2])
    return cache, seg


def untouched(seg: "torch.Tensor") -> bool:
    return bool((seg[3:] == 0).all())


@pytest.mark.parametrize(
    "blocks,exc,match",
    [
        ([3, 8], IndexError, "block id 8 is outside"),
        ([-1, 3], IndexError, "block id -1"),
        ([3, 3], ValueError, "appears twice"),
        ([3], ValueError, "allocate\\(32\\).s result: 1 block ids; expected 2"),
        ([3, 4, 5], ValueError, "expected 2"),
        ("ab", TypeError, "sequence of ints"),
        ([1.5, 2.0], TypeError, "integers"),
        (torch.tensor([3.0, 4.0]), TypeError, "integers"),
        (5, TypeError, "sequence of ints"),
    ],
)
def test_bad_allocate_results_raise_and_write_nothing(setup, blocks, exc, match) -> None:
    cache, seg = setup
    with pytest.raises(exc, match=match):
        cache.try_resume("b", torch.arange(2 * B + 1), lambda n: blocks)
    assert untouched(seg)
    assert cache.stats().pages_busy == 0


def test_allocate_exceptions_propagate_and_release_pages(setup) -> None:
    cache, seg = setup

    def boom(n: int) -> list[int]:
        raise RuntimeError("engine out of blocks")

    with pytest.raises(RuntimeError, match="engine out of blocks"):
        cache.try_resume("b", torch.arange(2 * B + 1), boom)
    assert cache.stats().pages_busy == 0
    assert untouched(seg)


@pytest.mark.parametrize(
    "prompt,exc,match",
    [
        ([], ValueError, "prompt is empty"),
        (np.zeros((2, 20), np.int32), ValueError, "1-D"),
        (np.arange(40, dtype=np.float32), TypeError, "integers"),
        (torch.arange(40, dtype=torch.float16), TypeError, "integers"),
        (np.array([2**40]), ValueError, "int32"),
        ("hello", TypeError, "sequence of ints"),
        (None, TypeError, "sequence of ints"),
        (7, TypeError, "sequence of ints"),
    ],
)
def test_bad_prompts_raise(setup, prompt, exc, match) -> None:
    cache, seg = setup
    with pytest.raises(exc, match=match):
        cache.try_resume("b", prompt, lambda n: [3, 4])
    assert untouched(seg)


@pytest.mark.parametrize(
    "tokens,blocks,exc,match",
    [
        (torch.arange(2 * B + 1), [0], ValueError, "2 full blocks but only 1 block_ids"),
        (torch.arange(2 * B + 1), [0, 99], IndexError, "block id 99"),
        (torch.arange(2 * B + 1), [-3, 1], IndexError, "block id -3"),
        (torch.arange(2 * B + 1), [[0, 1]], ValueError, "1-D"),
        (torch.arange(2 * B + 1), np.array([0.0, 1.0]), TypeError, "integers"),
        (torch.arange(2 * B + 1).view(1, -1), [0, 1], ValueError, "1-D"),
    ],
)
def test_bad_store_arguments_raise_and_store_nothing(setup, tokens, blocks, exc, match) -> None:
    cache, _ = setup
    before = cache.stats().pages_used
    with pytest.raises(exc, match=match):
        cache.store("c", tokens + 1000, blocks)
    assert cache.stats().pages_used == before


@pytest.mark.parametrize("request_id", [None, 1.5, b"x", True, ["a"]])
def test_bad_request_ids_raise_type_error(setup, request_id) -> None:
    cache, _ = setup
    with pytest.raises(TypeError, match="request_id"):
        cache.try_resume(request_id, [1] * 40, lambda n: [3, 4])
    with pytest.raises(TypeError, match="request_id"):
        cache.forget(request_id)


def test_unknown_request_raises_key_error(setup) -> None:
    cache, _ = setup
    with pytest.raises(hicache.UnknownRequestError, match="unknown request 'nope'"):
        cache.forget("nope")


@pytest.mark.parametrize("stream", [-1, "0", 1.0])
def test_bad_streams_raise(setup, stream) -> None:
    cache, _ = setup
    with pytest.raises((TypeError, ValueError), match="stream"):
        cache.try_resume("b", torch.arange(40), lambda n: [3, 4], stream=stream)


def test_bad_salt_type_raises(setup) -> None:
    cache, _ = setup
    with pytest.raises(TypeError, match="salt"):
        cache.try_resume("b", torch.arange(40), lambda n: [3, 4], salt=5)  # type: ignore[arg-type]


def test_a_state_in_several_tensors_is_checked_part_by_part() -> None:
    seg = torch.zeros(8, B, 4, dtype=torch.float16)
    for bad, err, match in [
        ([], ValueError, "empty list"),
        ([8, 0], ValueError, r"state_bytes\[1\]"),
        ([8, -1], ValueError, r"state_bytes\[1\]"),
        ([8, "4"], TypeError, r"state_bytes\[1\]"),
        ([8, 2.5], TypeError, r"state_bytes\[1\]"),
    ]:
        with pytest.raises(err, match=match):
            hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=8, state_bytes=bad, capacity_states=2)
    cache = hicache.HostPrefixCache(
        seg, block_tokens=B, capacity_pages=8, state_bytes=[8, 4], capacity_states=2
    )
    assert cache.state_bytes == 12
    a, b = torch.full((2,), 3.0), torch.full((2,), 7, dtype=torch.int16)  # float32 and int16 parts
    with pytest.raises(ValueError, match="state_out must be 2 parts of"):
        cache.try_resume("r", torch.arange(40), lambda n: [3, 4], state_out=a)
    with pytest.raises(ValueError, match="state_out part 1 must be 4 bytes"):
        cache.try_resume("r", torch.arange(40), lambda n: [3, 4], state_out=[a, a])
    with pytest.raises(TypeError, match="state_out part 1"):
        cache.try_resume("r", torch.arange(40), lambda n: [3, 4], state_out=[a, "b"])
    with pytest.raises(ValueError, match=r"state_export\(32\) part 0 must return 8 bytes"):
        cache.store("s", torch.arange(2 * B + 1), [0, 1], state_export=lambda pos: [b, b])
    assert cache.store("s", torch.arange(2 * B + 1), [0, 1], state_export=lambda pos: (a, b)) == 2
    cache.poll()
    out = [torch.zeros(2), torch.zeros(2, dtype=torch.int16)]
    assert cache.try_resume("t", torch.arange(2 * B + 1), lambda n: [3, 4], state_out=out) == 2 * B
    assert torch.equal(out[0], a) and torch.equal(out[1], b)


def test_state_buffers_are_checked() -> None:
    seg = torch.zeros(8, B, 4, dtype=torch.float16)
    cache = hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=8, state_bytes=16, capacity_states=2)
    with pytest.raises(ValueError, match="pass state_out"):
        cache.try_resume("a", torch.arange(40), lambda n: [3, 4])
    with pytest.raises(ValueError, match="state_out must be 16 bytes"):
        cache.try_resume("a", torch.arange(40), lambda n: [3, 4], state_out=torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        cache.try_resume(
            "a", torch.arange(40), lambda n: [3, 4], state_out=torch.zeros(32, dtype=torch.uint8)[::2]
        )
    with pytest.raises(ValueError, match=r"state_export\(32\) must return 16 bytes"):
        cache.store(
            "a", torch.arange(2 * B + 1), [0, 1], state_export=lambda pos: torch.zeros(5, dtype=torch.uint8)
        )
    with pytest.raises(TypeError, match=r"state_export\(32\)'s result must be a tensor or array"):
        cache.store("a", torch.arange(2 * B + 1), [0, 1], state_export=lambda pos: "state")


@pytest.mark.parametrize(
    "make_segments,match",
    [
        (lambda: [], "at least one"),
        (lambda: [torch.zeros(8, B, 4)[:, :, ::2]], "contiguous"),
        (lambda: [torch.zeros(8, B, 4), torch.zeros(9, B, 4)], "every segment must index the same blocks"),
        (lambda: [torch.zeros(8, B, 4).transpose(1, 2)], "contiguous"),
        (lambda: [torch.zeros(8, 4).as_strided((8, 4), (2, 1))], "overlap"),
        (lambda: [torch.zeros(0, 4)], "segment 0 has no blocks"),
    ],
)
def test_bad_segments_raise(make_segments, match) -> None:
    with pytest.raises(ValueError, match=match):
        hicache.HostPrefixCache(make_segments(), block_tokens=B, capacity_pages=4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(capacity_pages=0), "capacity_pages must be >= 1"),
        (dict(capacity_pages=4, keep_tokens=0), "keep_tokens"),
        (dict(capacity_pages=4, block_tokens=0), "block_tokens"),
        (dict(capacity_pages=4, state_bytes=8), "capacity_states"),
        (dict(capacity_pages=4, copier="gpu"), "copier must be"),
        (dict(capacity_pages=4, key_bits=0), "key_bits"),
        (dict(), "exactly one of capacity_pages and host_bytes"),
        (dict(capacity_pages=4, host_bytes=100), "exactly one"),
        (dict(host_bytes=10), "holds no page"),
        (dict(capacity_pages=4, cuda_blocks=0), "cuda_blocks must be >= 1"),
        (dict(capacity_pages=4, cuda_staging_bytes=-1), "cuda_staging_bytes must be >= 0"),
        (dict(capacity_pages=4, cuda_path="fast"), "cuda_path must be one of"),
    ],
)
def test_bad_configs_raise(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        hicache.HostPrefixCache(torch.zeros(8, B, 4), block_tokens=kwargs.pop("block_tokens", B), **kwargs)


def test_shortened_keys_with_a_tier_raise(tmp_path) -> None:
    # A tier's record names a page's prefix only by its parent's key (tests/cpp/test_tier.cpp
    # shows a colliding one passing): key_bits (tests only) is refused with a tier, and only there.
    kv = torch.zeros(8, B, 4)
    tier = hicache.DiskTier(tmp_path / "disk", 64 << 20)
    with pytest.raises(ValueError, match=r"key_bits must be 128 with a tier \(got 2\)"):
        hicache.HostPrefixCache(kv, block_tokens=B, capacity_pages=4, key_bits=2, tier=tier)
    hicache.HostPrefixCache(kv, block_tokens=B, capacity_pages=4, key_bits=128, tier=tier)
    hicache.HostPrefixCache(kv, block_tokens=B, capacity_pages=4, key_bits=2)


def test_cuda_segments_without_a_cuda_build_raise() -> None:
    if hicache.cuda_available():
        pytest.skip("this build has CUDA: covered by the GPU tests")
    meta = torch.zeros(8, B, 4, device="meta")
    with pytest.raises((ValueError, TypeError)):
        hicache.HostPrefixCache(meta, block_tokens=B, capacity_pages=4)


def test_hostile_calls_leave_canary_bytes_around_the_buffers_intact() -> None:
    # The segment and the state buffer are views into larger tensors whose guard regions hold a
    # pattern: no call, good or bad, may write outside the views.
    backing = torch.full((2 + 8 + 2, B, 4), 7.0, dtype=torch.float16)
    seg = backing[2:10]
    state_backing = torch.full((64,), 0x5A, dtype=torch.uint8)
    state = state_backing[16:48]
    cache = hicache.HostPrefixCache(seg, block_tokens=B, capacity_pages=4, state_bytes=32, capacity_states=2)
    seg.zero_()
    cache.store("a", torch.arange(2 * B + 1), [0, 1, 2], state_export=lambda pos: state)
    fresh = torch.arange(2 * B) + 99  # a new prefix: the cache asks for its states
    hostile = [
        lambda: cache.try_resume("b", torch.arange(2 * B + 1), lambda n: [7, 8], state_out=state),
        lambda: cache.try_resume("b", torch.arange(2 * B + 1), lambda n: [-1, 0], state_out=state),
        lambda: cache.try_resume("b", torch.arange(2 * B + 1), lambda n: [2**40, 0], state_out=state),
        lambda: cache.try_resume("b", torch.arange(2 * B + 1), lambda n: [3, 3], state_out=state),
        lambda: cache.try_resume("b", torch.arange(2 * B + 1), lambda n: [3, 4], state_out=state_backing),
        lambda: cache.try_resume("b", torch.arange(2 * B + 1), lambda n: [3, 4], state_out=state[::2]),
        lambda: cache.store("c", torch.arange(3 * B), [0, 1, 8]),
        lambda: cache.store("c", torch.arange(3 * B), [0, 1, -2]),
        lambda: cache.store("c", fresh, [5, 6], state_export=lambda pos: state_backing),
        lambda: cache.store("c", fresh, [5, 6], state_export=lambda pos: torch.zeros(2, B, 4)),
    ]
    for call in hostile:
        with pytest.raises((ValueError, IndexError, TypeError)):
            call()
    assert (backing[:2] == 7.0).all() and (backing[10:] == 7.0).all()
    assert (state_backing[:16] == 0x5A).all() and (state_backing[48:] == 0x5A).all()
    cache.poll()  # retires (and discards) the copies of the stores that raised
    assert cache.stats().pages_busy == 0 and cache.stats().states_busy == 0
    # And the good call still works, writing only inside the views.
    assert cache.try_resume("d", torch.arange(2 * B + 1), lambda n: [3, 4], state_out=state) == 2 * B
    assert (backing[:2] == 7.0).all() and (backing[10:] == 7.0).all()
    assert (state_backing[:16] == 0x5A).all() and (state_backing[48:] == 0x5A).all()
