"""Fixtures every Python suite shares (tests/py, tests/vllm, tests/sglang): standard library only,
since each suite runs in its own environment."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import pytest

SHARED_REGION_LOCK = "/tmp/hicache-tests-shared-regions.lock"


@pytest.fixture
def shared_region_lock() -> Iterator[None]:
    """Held by tests that create shared regions. Creating one sweeps every region on the machine
    whose creator died, so a test that leaves a killed process's region to look at it could lose
    it to a region test beside it (another checkout's run). The C++ region tests hold the same
    flock (tests/cpp/shared_region_lock.hpp)."""
    fd = os.open(SHARED_REGION_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
