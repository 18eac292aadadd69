"""Shared fixtures. GPU tests are skipped here, centrally, and never fall back to the CPU."""

from __future__ import annotations

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
