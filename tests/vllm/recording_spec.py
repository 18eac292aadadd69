"""Test-only wrappers of hicache's vLLM spec: they record what crosses the host tier so a test can
compare every loaded block, byte for byte, with what was stored under its key.

vLLM runs here in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one CPU worker), so the
scheduler-side manager and the worker share this module's globals.
"""

from __future__ import annotations

import os
from collections.abc import Collection

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadKey, ReqContext

from hicache.vllm import HicacheLoadStoreSpec, HicacheManager, HicacheOffloadingSpec, HicacheWorker

SLOT_KEY: dict[int, bytes] = {}  # host slot -> the vLLM key it holds (set by the manager)
STORED: dict[bytes, bytes] = {}  # vLLM key -> the page bytes stored under it
LOG = {"loaded_blocks": 0, "stored_blocks": 0, "byte_mismatches": 0, "checked_blocks": 0}
MANAGERS: list[HicacheManager] = []
REPORTED: dict[str, float] = {}  # counters summed (gauges: last) over vLLM's get_stats() calls


class RecordingManager(HicacheManager):
    def get_stats(self):  # type: ignore[no-untyped-def]
        stats = super().get_stats()
        for name, value in stats.reduce().items():
            counter = name.removeprefix("vllm:hicache_") in ("lookup_hits", "blocks_loaded", "blocks_stored")
            REPORTED[name] = REPORTED.get(name, 0) + value if counter else value
        return stats

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = super().prepare_load(keys, req_context)
        for slot, key in zip(spec.block_ids.tolist(), keys, strict=True):
            SLOT_KEY[slot] = bytes(key)
        return spec

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext):  # type: ignore[no-untyped-def]
        out = super().prepare_store(keys, req_context)
        if out is not None:
            for slot, key in zip(out.store_spec.block_ids.tolist(), out.keys_to_store, strict=True):
                SLOT_KEY[slot] = bytes(key)
        return out


class RecordingWorker(HicacheWorker):
    corrupt = False

    def __init__(
        self, kv_caches: CanonicalKVCaches, num_slots: int, shared_memory: str | None, *args: object
    ) -> None:
        super().__init__(kv_caches, num_slots, shared_memory, *args)  # type: ignore[arg-type]
        self.pending: dict[int, tuple[bool, list[int], list[int]]] = {}

    def _page(self, block: int) -> bytes:
        return b"".join(t[block].numpy().tobytes() for t in self.segments)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, HicacheLoadStoreSpec)
        self.pending[job_id] = (True, dst_spec.block_ids.tolist(), src_spec.block_ids.tolist())
        return super().submit_store(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, HicacheLoadStoreSpec)
        self.pending[job_id] = (False, src_spec.block_ids.tolist(), dst_spec.block_ids.tolist())
        return super().submit_load(job_id, src_spec, dst_spec)

    def get_finished(self):  # type: ignore[no-untyped-def]
        done = super().get_finished()
        for r in done:
            to_host, slots, blocks = self.pending.pop(r.job_id)
            for slot, block in zip(slots, blocks, strict=True):
                key = SLOT_KEY[slot]
                if to_host:
                    STORED[key] = self.mover.slot_bytes(slot)
                    LOG["stored_blocks"] += 1
                    continue
                if self.corrupt:  # the negative control: what hicache returns is wrong
                    for t in self.segments:
                        t[block].copy_(
                            torch.from_numpy(
                                np.random.default_rng(block).integers(-128, 127, t.shape[1], dtype=np.int8)
                            )
                        )
                LOG["loaded_blocks"] += 1
                LOG["checked_blocks"] += 1
                if self._page(block) != STORED.get(key):
                    LOG["byte_mismatches"] += 1
        return done


class RecordingSpec(HicacheOffloadingSpec):
    def get_manager(self):  # type: ignore[no-untyped-def]
        if self._manager is None:
            self._manager = RecordingManager(self.num_slots, self.eviction, self.admission, False)
            MANAGERS.append(self._manager)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches):  # type: ignore[no-untyped-def]
        if self._worker is None:
            RecordingWorker.corrupt = os.environ.get("HICACHE_TEST_CORRUPT") == "1"
            self._worker = RecordingWorker(kv_caches, self.num_slots, None)
        return self._worker


class CountingSpec(HicacheOffloadingSpec):
    """hicache's spec as shipped; only the scheduler-side manager is kept for the test to read
    (with tensor parallelism the workers are other processes)."""

    def get_manager(self):  # type: ignore[no-untyped-def]
        manager = super().get_manager()
        if manager not in MANAGERS:
            MANAGERS.append(manager)  # type: ignore[arg-type]
        return manager
