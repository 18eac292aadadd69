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


@pytest.mark.usefixtures("shared_region_lock")
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


@pytest.mark.usefixtures("shared_region_lock")
def test_a_process_mapping_a_pool_of_another_size_is_refused() -> None:
    name = f"hicache-pytest-size-{os.getpid()}"
    kv = np.zeros((2, PAGE), np.uint8)
    owner = _core.SlotMover([kv], 4, "cpu", name, True, 4 * PAGE)
    owner.wait([owner.submit(True, np.array([0], np.int64), np.array([0], np.int64), 0)])
    other = _core.SlotMover([kv], 5, "cpu", name, False, 5 * PAGE)
    with pytest.raises(Exception, match="holds 4194304 bytes"):
        other.submit(True, np.array([0], np.int64), np.array([0], np.int64), 0)


def _workload(seed: int, requests: int, block: int) -> list[np.ndarray]:
    """Prompts over a few shared prefixes (system prompts, conversations that grow, one-offs)."""
    rng = np.random.default_rng(seed)
    roots = [rng.integers(0, 1000, 4 * block) for _ in range(3)]
    convs: list[np.ndarray] = []
    out = []
    for _ in range(requests):
        r = rng.random()
        if r < 0.4 and convs:  # a conversation's next turn
            i = int(rng.integers(len(convs)))
            convs[i] = np.concatenate([convs[i], rng.integers(0, 1000, int(rng.integers(1, 3 * block)))])
            out.append(convs[i])
        elif r < 0.8:  # a new conversation under a shared system prompt
            conv = np.concatenate(
                [roots[int(rng.integers(3))], rng.integers(0, 1000, int(rng.integers(1, 4 * block)))]
            )
            convs.append(conv)
            out.append(conv)
        else:  # a one-off
            out.append(rng.integers(0, 1000, int(rng.integers(block, 8 * block))))
    return out


def _one_call_and_split(admission: str, catalog_eviction: str = "leaf-first") -> dict[str, object]:
    """One workload through HostPrefixCache and through BlockCatalog + SlotMover (as the vLLM spec
    drives them), with a pool small enough to evict and decline; what each served and kept."""
    import hicache

    block, cap, blocks = 16, 24, 64
    page = 8  # bytes a token: one segment of block * page bytes a block
    prompts = _workload(5, 400, block)
    cache_kv = np.zeros((blocks, block * page), np.uint8)
    split_kv = np.zeros((blocks, block * page), np.uint8)
    cache = hicache.HostPrefixCache(cache_kv, block_tokens=block, capacity_pages=cap, admission=admission)
    catalog = _core.BlockCatalog(cap, catalog_eviction, admission)
    mover = _core.SlotMover([split_kv], cap, "cpu", None, False, cap * block * page)

    def content(tokens: np.ndarray, n_pages: int) -> np.ndarray:  # what the engine computes
        t = tokens[: n_pages * block].reshape(n_pages, block).astype(np.uint8)
        return np.tile(t, (1, page)) + np.arange(n_pages, dtype=np.uint8)[:, None]

    served_cache, served_split, stored_cache, stored_split = [], [], 0, 0
    for n, prompt in enumerate(prompts):
        full = len(prompt) // block
        limit = (len(prompt) - 1) // block  # keep_tokens = 1
        keys = hicache.chain_keys(prompt, block)
        # One call.
        got = cache.try_resume(n, prompt, lambda k: list(range(k // block)))
        served_cache.append(got)
        if got:
            assert np.array_equal(cache_kv[: got // block], content(prompt, got // block))
        cache_kv[:full] = content(prompt, full)
        stored_cache += cache.store(n, prompt, list(range(full)))
        cache.poll()
        cache.forget(n)
        # Split: look up, pin, load, touch; then plan the store, copy, complete.
        hit = 0
        while hit < limit and catalog.lookup(keys[hit]) == 1:  # 1: loadable
            hit += 1
        if hit:
            slots = catalog.prepare_load(keys[:hit])
            mover.wait([mover.submit(False, np.array(slots, np.int64), np.arange(hit, dtype=np.int64), 0)])
            catalog.complete_load(keys[:hit])
            catalog.touch(keys[:hit])
            assert np.array_equal(split_kv[:hit], content(prompt, hit))
        served_split.append(hit * block)
        split_kv[:full] = content(prompt, full)
        accepted, slots, _ = catalog.prepare_store(keys, None)
        if accepted:
            mover.wait([mover.submit(True, np.array(slots, np.int64), np.array(accepted, np.int64), 0)])
            catalog.complete_store([keys[i] for i in accepted], True)
        stored_split += len(accepted)
    s, c = cache.stats(), catalog.stats()
    every = {k for p in prompts for k in hicache.chain_keys(p, block)}
    return {
        "served": (served_cache, served_split),
        "stored": (stored_cache, stored_split),
        "counts": (
            (s.pages_evicted, s.pages_used, s.pages_declined),
            (c["evictions"], c["used"], c["blocks_declined"]),
        ),
        "held": (set(cache.page_lru_order()), {k for k in every if catalog.lookup(k) == 1}),
        "stats": s,
    }


@pytest.mark.parametrize("admission", ["adaptive", "second-sighting", "always"])
def test_the_one_call_cache_and_the_split_halves_make_the_same_decisions(admission: str) -> None:
    # try_resume/store and the split API walk chains with the same code (chain_walk.hpp): they
    # serve the same tokens, store the same pages and end holding the same keys, and the bytes
    # each loads are the pages stored under those keys.
    r = _one_call_and_split(admission)
    for what in ("served", "stored", "counts", "held"):
        one_call, split = r[what]  # type: ignore[misc]
        assert one_call == split, what
    # The workload exercised what it is meant to: hits, evictions and (but for write-through)
    # declined pages.
    s = r["stats"]
    assert sum(x > 0 for x in r["served"][0]) > 50 and s.pages_evicted > 100  # type: ignore[index, attr-defined]
    assert (s.pages_declined > 0) == (admission != "always")  # type: ignore[attr-defined]


def test_the_same_decisions_check_has_teeth() -> None:
    # A catalog that evicts differently (plain LRU) is caught.
    r = _one_call_and_split("adaptive", catalog_eviction="lru")
    assert any(r[what][0] != r[what][1] for what in ("served", "stored", "counts", "held"))  # type: ignore[index]


def test_the_movers_copy_path_options_are_checked_by_name_on_any_device() -> None:
    kv = np.zeros((4, 1024), np.uint8)
    assert _core.SlotMover([kv], 4, "cpu", None, False, 1 << 20).copy_path == "cpu"
    forced = _core.SlotMover([kv], 4, "cpu", None, False, 1 << 20, cuda_path="kernel", cuda_blocks=8)
    assert forced.copy_path == "cpu"  # valid CUDA options are accepted, and the CPU copier copies
    with pytest.raises(ValueError, match="cuda_path must be 'auto', 'dma', 'staged' or 'kernel', not 'pcie'"):
        _core.SlotMover([kv], 4, "cpu", None, False, 1 << 20, cuda_path="pcie")
    with pytest.raises(ValueError, match=r"cuda_blocks must be in \[1, 1024\]"):
        _core.SlotMover([kv], 4, "cpu", None, False, 1 << 20, cuda_blocks=0)
