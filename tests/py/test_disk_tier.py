"""The disk tier from Python: an engine restarted (or killed) serves what it stored, exactly;
damaged files, a full disk, a read-only or tmpfs directory cost misses, never a wrong page or an
exception into the engine; one process writes a directory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import hicache

B, PAGE = 16, 4096


def kv_pages(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.arange(pages * B + 1, dtype=np.int32) + seed * 100_000


def cache_over(tier: hicache.Tier, kv: np.ndarray, **kw) -> hicache.HostPrefixCache:
    kw.setdefault("tier_wait_ms", 5000)
    return hicache.HostPrefixCache(kv, block_tokens=B, capacity_pages=kv.shape[0], tier=tier, **kw)


def resume(cache: hicache.HostPrefixCache, kv: np.ndarray, rid: str, p: np.ndarray) -> int:
    kv[:] = 0
    return cache.try_resume(rid, p, lambda n: list(range(n // B)))


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    return tmp_path / "disk"


def test_a_restarted_engine_serves_what_the_last_one_stored_exactly(disk: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, numpy as np, hicache
        B, PAGE = 16, 4096
        kv = np.random.default_rng(5).integers(0, 256, (8, PAGE), dtype=np.uint8)
        cache = hicache.HostPrefixCache(kv, block_tokens=B, capacity_pages=8,
                                        tier=hicache.DiskTier(sys.argv[1], 64 << 20))
        assert cache.store("a", np.arange(8 * B + 1, dtype=np.int32), list(range(8))) == 8
        cache.flush_tier()
        print(cache.stats().tier_pages_written)
        """
    )
    run = [sys.executable, "-c", script, str(disk)]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["8"], out.stderr
    tier = hicache.DiskTier(disk, 64 << 20)
    kv = np.zeros((8, PAGE), np.uint8)
    cache = cache_over(tier, kv)
    assert resume(cache, kv, "b", np.arange(8 * B + 1, dtype=np.int32)) == 8 * B
    assert np.array_equal(kv, kv_pages(5, 8))
    s = cache.stats()
    assert (s.tier_hit_tokens, s.tier_pages_rejected) == (8 * B, 0)
    assert tier.stats()["index_files_used"] == 1
    # Another layout (pages of 8 KiB) or another salt over the same directory: never served.
    other = np.zeros((8, 2 * PAGE), np.uint8)
    wide = hicache.HostPrefixCache(other, block_tokens=B, capacity_pages=8, tier=tier, tier_wait_ms=5000)
    assert wide.try_resume("c", np.arange(8 * B + 1, dtype=np.int32), lambda n: list(range(n // B))) == 0
    assert cache.try_resume("d", np.arange(8 * B + 1, dtype=np.int32), lambda n: [0] * 0, salt=b"x") == 0
    assert wide.stats().tier_pages_rejected == 0  # not found at all: their names differ


KILLED_WRITER = textwrap.dedent(
    """
    import sys, numpy as np, hicache
    B, PAGE = 16, 4096
    tier = hicache.DiskTier(sys.argv[1], 256 << 20, segment_bytes=1 << 20)
    kv = np.zeros((8, PAGE), np.uint8)
    cache = hicache.HostPrefixCache(kv, block_tokens=B, capacity_pages=8, tier=tier)
    n = 0
    while True:  # until killed: 8 new pages a round, each round flushed and reported
        kv[:] = np.random.default_rng(n).integers(0, 256, (8, PAGE), dtype=np.uint8)
        cache.store(str(n), np.arange(8 * B + 1, dtype=np.int32) + n * 100_000, list(range(8)))
        cache.flush_tier()
        cache.forget(str(n))
        print(n, flush=True)
        n += 1
    """
)


def test_sigkill_while_writing_loses_at_most_what_was_in_flight_never_a_page(disk: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(disk)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    flushed = -1
    for line in p.stdout:
        flushed = int(line)
        if flushed >= 40:
            break
    p.send_signal(signal.SIGKILL)  # mid-write of the next rounds
    p.wait(timeout=30)
    tier = hicache.DiskTier(disk, 256 << 20, segment_bytes=1 << 20)  # its lock died with it
    kv = np.zeros((8, PAGE), np.uint8)
    cache = cache_over(tier, kv)
    for n in range(flushed + 3):
        got = resume(cache, kv, f"r{n}", np.arange(8 * B + 1, dtype=np.int32) + n * 100_000)
        want = np.random.default_rng(n).integers(0, 256, (8, PAGE), dtype=np.uint8)
        assert np.array_equal(kv[: got // B], want[: got // B]), f"round {n}: a wrong page"
        if n <= flushed:
            assert got == 8 * B, f"round {n} was flushed before the kill and is gone"
        cache.forget(f"r{n}")
    assert cache.stats().tier_pages_rejected == 0
    assert tier.stats()["segments_scanned"] >= 1  # the one being written had no index file


def test_a_damaged_page_on_disk_is_a_miss_counted_never_served(disk: Path) -> None:
    kv = kv_pages(1, 8)
    tier = hicache.DiskTier(disk, 64 << 20)
    a = cache_over(tier, kv)
    assert a.store("a", prompt(1, 8), list(range(8))) == 8
    a.flush_tier()
    del a, tier
    seg = sorted(disk.glob("seg-*.hcd"))[0]
    data = bytearray(seg.read_bytes())
    # A byte of page 3: each entry is 8 KiB here, a 4 KiB lead block (header, record), then the
    # page's 4 KiB.
    data[3 * 8192 + 4096 + 100] ^= 0xFF
    seg.write_bytes(bytes(data))
    tier = hicache.DiskTier(disk, 64 << 20)
    kv_b = np.zeros_like(kv)
    b = cache_over(tier, kv_b)
    got = resume(b, kv_b, "b", prompt(1, 8))
    assert got == 3 * B and np.array_equal(kv_b[:3], kv[:3])  # up to the damaged page
    assert b.stats().tier_pages_rejected == 1 and b.stats().errors == 0


def test_a_second_process_on_the_directory_is_refused_and_caches_of_one_process_share_it(disk: Path) -> None:
    tier = hicache.DiskTier(disk, 64 << 20)
    script = f"import hicache; hicache.DiskTier({str(disk)!r}, 64 << 20)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"in use by another DiskTier (process {os.getpid()})" in out.stderr, out.stderr
    # Two caches (two engines' workers, say) in this process over the one object: one stores,
    # the other is served, concurrently with more stores.
    kv_a, kv_b = kv_pages(2, 8), np.zeros((8, PAGE), np.uint8)
    a, b = cache_over(tier, kv_a), cache_over(tier, kv_b)
    assert a.store("a", prompt(2, 8), list(range(8))) == 8
    a.flush_tier()
    assert resume(b, kv_b, "b", prompt(2, 8)) == 8 * B and np.array_equal(kv_b, kv_a)


def test_bad_arguments_are_named(disk: Path) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        hicache.DiskTier(disk, 100)
    with pytest.raises(ValueError, match="direct_io"):
        hicache.DiskTier(disk, 1 << 20, direct_io="yes")
    with pytest.raises(TypeError, match="path"):
        hicache.DiskTier(3, 1 << 20)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="segment_bytes"):
        hicache.DiskTier(disk, 1 << 20, segment_bytes=100)
    (disk / "x").mkdir(parents=True)
    (disk / "x" / "FORMAT").write_text("another format\n")
    with pytest.raises(hicache.CacheError, match="holds another format"):
        hicache.DiskTier(disk / "x", 1 << 20)


# --- filesystems that say no: tmpfs, full, read-only (mounted here: needs root) -------------------


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    where = Path(f"/tmp/hicache-tmpfs-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_a_directory_on_tmpfs_serves_with_or_without_direct_io(direct_io: str) -> None:
    # tmpfs takes O_DIRECT on recent kernels (6.6 and later) and not on older ones: "auto" asks
    # the filesystem (a probe file); "off" always writes through the page cache.
    with tmpfs("16m") as fs:
        tier = hicache.DiskTier(fs / "t", 8 << 20, direct_io=direct_io)
        if direct_io == "off":
            assert tier.stats()["direct_io"] is False
        kv = kv_pages(3, 8)
        c = cache_over(tier, kv)
        assert c.store("a", prompt(3, 8), list(range(8))) == 8
        c.flush_tier()
        del c, tier
        tier = hicache.DiskTier(fs / "t", 8 << 20, direct_io=direct_io)
        kv_b = np.zeros_like(kv)
        b = cache_over(tier, kv_b)
        assert resume(b, kv_b, "b", prompt(3, 8)) == 8 * B and np.array_equal(kv_b, kv)


def test_a_full_disk_costs_failed_writes_counted_and_never_the_engine() -> None:
    with tmpfs("1m") as fs:
        # The directory may hold 64 MiB; the filesystem holds 1 MiB: ENOSPC.
        tier = hicache.DiskTier(fs / "t", 64 << 20, segment_bytes=256 << 10)
        kv = np.zeros((8, PAGE), np.uint8)
        c = cache_over(tier, kv)
        for n in range(40):
            kv[:] = kv_pages(100 + n, 8)
            c.store(str(n), prompt(100 + n, 8), list(range(8)))
            c.flush_tier()
            c.forget(str(n))
        s, d = c.stats(), tier.stats()
        assert s.tier_pages_failed > 0 and s.errors == 0 and not s.disabled
        assert s.tier_pages_written + s.tier_pages_failed == 40 * 8
        assert d["write_failures"] > 0 and "No space left" in d["last_error"]
        # What was written is served exactly; what failed is a miss.
        served = 0
        for n in range(40):
            got = resume(c, kv, f"r{n}", prompt(100 + n, 8))
            assert np.array_equal(kv[: got // B], kv_pages(100 + n, 8)[: got // B])
            served += got > 0
            c.forget(f"r{n}")
        assert served > 0


def test_a_read_only_directory_serves_and_counts_the_writes_it_cannot_take() -> None:
    with tmpfs("16m") as fs:
        kv = kv_pages(4, 8)
        tier = hicache.DiskTier(fs / "t", 8 << 20)
        c = cache_over(tier, kv)
        assert c.store("a", prompt(4, 8), list(range(8))) == 8
        c.flush_tier()
        del c, tier
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        tier = hicache.DiskTier(fs / "t", 8 << 20)
        assert tier.stats()["read_only"] is True
        kv_b = np.zeros_like(kv)
        b = cache_over(tier, kv_b)
        assert resume(b, kv_b, "b", prompt(4, 8)) == 8 * B and np.array_equal(kv_b, kv)
        kv_b[:] = kv_pages(5, 8)
        b.store("c", prompt(5, 8), list(range(8)))
        b.flush_tier()
        assert b.stats().tier_pages_failed == 8 and b.stats().errors == 0
