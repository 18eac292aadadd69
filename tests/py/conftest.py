"""Shared fixtures. GPU tests are skipped here, centrally, and never fall back to the CPU."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import hicache

try:
    import torch
except ImportError:  # pragma: no cover - the test script always installs torch
    torch = None  # type: ignore[assignment]

HAS_GPU = bool(torch is not None and torch.cuda.is_available() and hicache.cuda_available())
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and a CUDA build of hicache")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def assert_freed_by_refcount(use: Callable[[], hicache.HostPrefixCache]) -> None:
    """``use()`` builds a cache, works with it and returns it; once the caller drops it, it must
    be gone at once, without the cycle collector: an engine that drops a cache gets its pinned
    memory back then, and nanobind reports no leaked instance at interpreter exit."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        cache = use()
        ref = weakref.ref(cache)
        del cache
        alive = ref()
        if alive is not None:
            holders = sorted({type(r).__name__ for r in gc.get_referrers(alive)})
            del alive
            pytest.fail(f"the cache outlived its last reference; referred to by {holders}")
    finally:
        if was_enabled:
            gc.enable()


def use_every_method(segments: list[Any], state: Any) -> hicache.HostPrefixCache:
    """Stores (with a state export), a hit (with a state import), a deferral, a forget and the
    read-only calls: what an engine does with a cache before dropping it."""
    b = 16  # block_tokens
    cache = hicache.HostPrefixCache(
        segments, block_tokens=b, capacity_pages=8, state_bytes=state.nbytes, capacity_states=2
    )
    prompt = torch.arange(3 * b + 1, device=state.device)
    cache.store("a", prompt, [0, 1, 2, 3], state_export=lambda pos: state if pos == 3 * b else None)
    if state.is_cuda:
        torch.cuda.synchronize()
    cache.poll()
    assert cache.try_resume("b", prompt, lambda n: [4, 5, 6], state_out=state) == 3 * b
    assert cache.try_resume("c", prompt, lambda n: None, state_out=state) == -1
    cache.forget("a")
    cache.stats_dict()
    if state.is_cuda:
        torch.cuda.synchronize()
    cache.poll()
    return cache
