"""A tier on a local disk: the cache survives the engine's restarts and holds more than RAM."""

from __future__ import annotations

import os
from typing import Any

from . import _arrays
from ._core import DiskTier as _CoreDiskTier


class DiskTier(_CoreDiskTier):
    """A :class:`hicache.Tier` in a local directory (``docs/tier.md``).

    Pages the host stores are written to segment files in ``path`` (write-through, off the
    engine's threads); a prompt that misses in host memory takes the rest of its prefix from
    there, checked as exactly as a host page, into host memory. A new process opening the same
    directory serves what earlier ones wrote; a page of another model, layout or salt is never
    found, and a torn or damaged file is a miss.

    Args:
        path: the directory (created if absent, with its parents). One process writes it: a
            second ``DiskTier`` on it is refused (``hicache.CacheError`` naming the holder's
            pid); caches of one process share it by sharing this object. A directory this
            process cannot write is opened read-only (served, not written).
        capacity_bytes: bytes of segment files the directory may hold (the oldest segment goes
            first; a page read from the older half is moved up, so pages in use stay).
        segment_bytes: bytes of one segment file; 0 (default): capacity/16 within 4-256 MiB.
        direct_io: ``"auto"`` (O_DIRECT where the filesystem allows it, not on tmpfs), ``"on"``
            or ``"off"``.
        read_threads: threads that read a batch's pages.

    Raises:
        ValueError / TypeError: a bad argument, named. ``hicache.CacheError``: the directory is
        held by another DiskTier, holds another format, or cannot be used at all.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        segment_bytes: int = 0,
        direct_io: str = "auto",
        read_threads: int = 8,
    ) -> None:
        try:
            p = os.fspath(path)
        except TypeError:
            raise TypeError(f"path must be a str or os.PathLike, not {_arrays.show(path)}") from None
        if not isinstance(p, str) or not p:
            raise ValueError(f"path must be a non-empty directory name, not {path!r}")
        i64 = 2**63 - 1
        capacity_bytes = _arrays.int_arg("capacity_bytes", capacity_bytes, 8192, i64)
        segment_bytes = _arrays.int_arg("segment_bytes", segment_bytes, 0, i64)
        if 0 < segment_bytes < 4096:
            raise ValueError(f"segment_bytes must be 0 (automatic) or at least 4096, not {segment_bytes}")
        direct_io = _arrays.choice_arg("direct_io", direct_io, ("auto", "on", "off"))
        read_threads = _arrays.int_arg("read_threads", read_threads, 1, 64)
        super().__init__(p, capacity_bytes, segment_bytes, direct_io, read_threads)
        self._opened = True

    def __repr__(self) -> str:
        if not hasattr(self, "_opened"):
            return "DiskTier(<not opened>)"
        s: dict[str, Any] = self.stats()
        return (
            f"DiskTier({self.path!r}, capacity_bytes={self.capacity_bytes}: {s['values']} pages, "
            f"{s['bytes_on_disk']} bytes, direct_io={s['direct_io']}, read_only={s['read_only']})"
        )
