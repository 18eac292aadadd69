"""The split API underneath the vLLM spec: a catalog in one process, copies in others, one pool.

Processes here are spawned (not forked): each maps the pool by name, as vLLM's worker processes do.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest

from hicache import _core

SLOTS, PAGE = 64, 1 << 20  # a 64 MiB pool of 1 MiB pages


def _shmem_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    raise RuntimeError("no Shmem in /proc/meminfo")


def _reader(name: str, slots: list[int], seed: int, out: mp.Queue) -> None:
    kv = np.zeros((len(slots), PAGE), np.uint8)
    mover = _core.SlotMover([kv], SLOTS, "cpu", name, False, SLOTS * PAGE)
    mover.wait([mover.submit(False, np.array(slots, np.int64), np.arange(len(slots), dtype=np.int64), 0)])
    want = np.random.default_rng(seed).integers(0, 256, (SLOTS, PAGE), dtype=np.uint8)[slots]
    out.put((os.getpid(), bool(np.array_equal(kv, want))))


def test_workers_in_other_processes_load_what_one_stored_and_the_pool_exists_once() -> None:
    name = f"hicache-pytest-{os.getpid()}"
    seed = 3
    kv = np.random.default_rng(seed).integers(0, 256, (SLOTS, PAGE), dtype=np.uint8)
    catalog = _core.BlockCatalog(SLOTS, "leaf-first", "always")
    keys = [i.to_bytes(16, "little") for i in range(SLOTS)]
    accepted, slots, evicted = catalog.prepare_store(keys, None)
    assert accepted == list(range(SLOTS)) and evicted == []
    before = _shmem_kib()
    writer = _core.SlotMover([kv], SLOTS, "cpu", name, True, SLOTS * PAGE)
    writer.wait([writer.submit(True, np.array(slots, np.int64), np.arange(SLOTS, dtype=np.int64), 0)])
    catalog.complete_store(keys, True)
    grown = _shmem_kib() - before
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    readers = [
        ctx.Process(target=_reader, args=(name, catalog.prepare_load(keys), seed, out)) for _ in range(3)
    ]
    for p in readers:
        p.start()
    results = [out.get(timeout=120) for _ in readers]
    for p in readers:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [ok for _, ok in results] == [True, True, True]
    # Four processes map the pool; host memory holds it once (64 MiB, not 256).
    assert 60 * 1024 <= grown <= 70 * 1024, grown
    assert _shmem_kib() - before < 70 * 1024
    catalog.complete_load(keys)


def test_a_process_mapping_a_pool_of_another_size_is_refused() -> None:
    name = f"hicache-pytest-size-{os.getpid()}"
    kv = np.zeros((2, PAGE), np.uint8)
    owner = _core.SlotMover([kv], 4, "cpu", name, True, 4 * PAGE)
    owner.wait([owner.submit(True, np.array([0], np.int64), np.array([0], np.int64), 0)])
    other = _core.SlotMover([kv], 5, "cpu", name, False, 5 * PAGE)
    with pytest.raises(Exception, match="holds 4194304 bytes"):
        other.submit(True, np.array([0], np.int64), np.array([0], np.int64), 0)
