"""hicache as vLLM's host tier: an ``OffloadingSpec`` for vLLM's ``OffloadingConnector``.

Start vLLM with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "HicacheOffloadingSpec",
        "spec_module_path": "hicache.vllm", "host_bytes": 68719476736}}'

The scheduler process gets a :class:`HicacheManager`: hicache's index half (``BlockCatalog``:
which block is in which host slot, hicache's admission policy and leaf-first eviction, events,
counters), keyed by vLLM's block hashes. Each worker process (one per GPU, or the CPU worker)
gets a :class:`HicacheWorker`: hicache's copier half (``SlotMover``) over the int8
``(num_blocks, page_bytes)`` views vLLM hands it, copying between the host slots the manager
chose and the engine's blocks, as jobs.

``kv_connector_extra_config`` keys:

- ``host_bytes`` (required): host memory for KV blocks across all workers (each worker holds
  its shard of every slot).
- ``admission``: ``"adaptive"`` (default), ``"second-sighting"`` or ``"always"``.
- ``eviction``: ``"leaf-first"`` (default) or ``"lru"``.
- ``shared_memory``: true to put each worker's slots in a region under ``/dev/shm``
  (``hicache-<engine_id>-<rank>``) that other processes of the same engine may map; with a
  replicated layout (MLA over tensor parallelism) the engine's workers share rank 0's region,
  so replicated latents are stored once, not once per rank. A region belongs to one engine: a
  second engine naming it (the same ``engine_id`` on one host) is refused at start-up, and
  regions left by a killed engine are removed when the next one starts (see ``docs/vllm.md``).

Supported: models with one KV cache group (full attention, MLA), offloaded blocks of one vLLM
block each (the connector's default). Anything else is refused at start-up with the reason.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from . import _core

_LOOKUP = {0: LookupResult.MISS, 1: LookupResult.HIT, 2: LookupResult.HIT_PENDING}

# hicache's catalog counters as vLLM metrics (vLLM exports them on its /metrics endpoint).
METRIC_COUNTERS = {
    "lookup_hits": "block lookups that found a block in hicache",
    "blocks_loaded": "blocks loaded from hicache",
    "blocks_stored": "blocks stored in hicache",
    "blocks_declined": "blocks hicache's admission policy declined",
    "blocks_no_room": "blocks not stored because every host slot was held",
    "evictions": "blocks evicted from hicache",
}
METRIC_GAUGES = {
    "used": "host slots holding a block",
    "capacity": "host slots",
    "admitting_second_sightings_only": "1 while hicache stores only blocks seen in a recent prompt",
}


def metric_name(key: str) -> str:
    return f"vllm:hicache_{key}"


class HicacheLoadStoreSpec(BlockIDsLoadStoreSpec):
    """Host slots of hicache's pool (``block_ids`` holds slot indices)."""


def catalog_key(key: OffloadKey) -> bytes:
    """vLLM's key (block hash + group index, any length) as hicache's 16-byte key."""
    return hashlib.blake2b(key, digest_size=16).digest()


@dataclass
class _RequestKeys:
    """The keys of one request seen so far, by end-token position (to name each store's parent).
    Positions are kept sorted (they mostly arrive in order, so inserting is at the end)."""

    positions: list[int] = field(default_factory=list)
    by_position: dict[int, bytes] = field(default_factory=dict)

    def note(self, ctx: ReqContext, key: OffloadKey, mine: bytes) -> None:
        pos = ctx.get_offload_key_position(key)
        if pos is None:
            return
        if pos not in self.by_position:
            bisect.insort(self.positions, pos)
        self.by_position[pos] = mine

    def parent_of(self, ctx: ReqContext, key: OffloadKey) -> bytes | None:
        pos = ctx.get_offload_key_position(key)
        if pos is None:
            return None
        i = bisect.bisect_left(self.positions, pos)
        return self.by_position[self.positions[i - 1]] if i > 0 else None


def _slots(config: OffloadingConfig) -> int:
    host_bytes = config.extra_config.get("host_bytes")
    if host_bytes is None:
        raise ValueError("hicache: kv_connector_extra_config needs host_bytes (host memory for KV blocks)")
    try:
        host_bytes = int(host_bytes)
    except (TypeError, ValueError):
        raise ValueError(f"hicache: host_bytes must be an integer, not {host_bytes!r}") from None
    per_slot = config.worker_kv_bytes_per_block * max(1, config.parallel.world_size)
    if per_slot <= 0:
        return 0  # vLLM builds a config without KV caches first (scheduler side, no blocks)
    slots = host_bytes // per_slot
    if slots < 1:
        raise ValueError(f"hicache: host_bytes={host_bytes} holds no block of {per_slot} bytes")
    return slots


class HicacheManager(OffloadingManager):
    """Scheduler side: hicache's BlockCatalog keyed by vLLM's block hashes."""

    def __init__(self, num_slots: int, eviction: str, admission: str, enable_events: bool) -> None:
        self.catalog = _core.BlockCatalog(num_slots, eviction, admission)
        self.enable_events = enable_events
        # hicache key -> vLLM key, for blocks stored or being stored (lookups add nothing, so
        # misses cost no memory)
        self._vllm_key: dict[bytes, OffloadKey] = {}
        self._reported: dict[str, Any] = {}  # counters as of the last get_stats()
        self._events: list[OffloadingEvent] = []  # for take_events (kept only if vLLM wants them)

    @staticmethod
    def _mine(keys: Iterable[OffloadKey]) -> list[bytes]:
        return [catalog_key(k) for k in keys]

    def _state(self, ctx: ReqContext) -> _RequestKeys:
        state = ctx.get_state(_RequestKeys)
        if state is None:
            state = _RequestKeys()
            ctx.set_state(state)
        return state

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        (mine,) = self._mine([key])
        self._state(req_context).note(req_context, key, mine)
        return _LOOKUP[self.catalog.lookup(mine)]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return HicacheLoadStoreSpec(self.catalog.prepare_load(self._mine(keys)))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.catalog.touch(self._mine(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.catalog.complete_load(self._mine(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
        mine = self._mine(keys)
        state = self._state(req_context)
        parent = state.parent_of(req_context, keys[0]) if keys else None
        for k, m in zip(keys, mine, strict=True):
            state.note(req_context, k, m)
        accepted, slots, evicted = self.catalog.prepare_store(mine, parent)
        for i in accepted:  # vLLM's names of the blocks hicache holds, for events and evictions
            self._vllm_key[mine[i]] = keys[i]
        evicted_keys = [self._vllm_key[e] for e in evicted if e in self._vllm_key]
        self._drain()
        return PrepareStoreOutput(
            keys_to_store=[keys[i] for i in accepted],
            store_spec=HicacheLoadStoreSpec(slots),
            evicted_keys=evicted_keys,
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.catalog.complete_store(self._mine(keys), success)
        self._drain()

    def _drain(self) -> None:
        """Takes the catalog's events: forgets the names of removed blocks (so the map holds only
        blocks in hicache) and, if vLLM wants events, keeps them for take_events."""
        stored, removed = self.catalog.take_events()
        if self.enable_events and stored:
            self._events.append(
                OffloadingEvent([self._vllm_key[m] for m in stored], Medium.CPU, removed=False)
            )
        gone = [self._vllm_key.pop(m) for m in removed if m in self._vllm_key]
        if self.enable_events and gone:
            self._events.append(OffloadingEvent(gone, Medium.CPU, removed=True))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._state(req_context)
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._drain()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        self.catalog.clear()
        self._drain()

    def stats(self) -> dict[str, Any]:
        """hicache's counters (a collector: :class:`hicache.metrics.HicacheCollector`)."""
        return dict(self.catalog.stats())

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Counters since the last call and current gauges, for vLLM's metrics."""
        now = self.stats()
        out = OffloadingConnectorStats()
        for key in METRIC_COUNTERS:
            out.increase_counter(metric_name(key), now[key] - self._reported.get(key, 0))
        for key in METRIC_GAUGES:
            out.set_gauge(metric_name(key), float(now[key]))
        self._reported = now
        return out


def _start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks after boot, /proc/<pid>/stat field 22)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def engine_owner(engine_id: str, world_size: int) -> str:
    """Who a worker's shared region belongs to: its engine's catalog, named by the engine id and
    the engine-core process (the workers' parent when the engine has several, which vLLM's
    multiprocessing executor starts from that process; the worker's own process when it is the
    only one). Two engines given the same engine_id therefore never name the same owner."""
    pid = os.getppid() if world_size > 1 else os.getpid()
    return f"vllm engine {engine_id}, engine core pid {pid} started at {_start_time(pid)}"


class HicacheWorker(OffloadingWorker):
    """Worker side: copies between vLLM's KV blocks and hicache's host slots, as jobs."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        num_slots: int,
        shared_memory: str | None,
        owner: str = "",
        create: bool = True,
    ) -> None:
        tensors = [t.tensor for t in kv_caches.tensors]
        if not tensors:
            raise ValueError("hicache: vLLM handed the worker no KV cache tensors")
        self.device = tensors[0].device
        self.segments = tensors  # kept alive: the mover copies into them
        page = sum(int(t.shape[1]) for t in tensors)
        self.mover = _core.SlotMover(
            tensors,
            max(1, num_slots),
            "auto",
            shared_memory,
            create,
            max(1 << 30, page * max(1, num_slots)) if shared_memory else 1 << 30,
            owner=owner,
        )
        self._jobs: dict[int, tuple[int, int, float]] = {}  # our job -> (vLLM job, bytes, start)
        self._done: list[TransferResult] = []

    def _stream(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.current_stream(self.device).cuda_stream)
        return 0

    def _submit(self, job_id: int, to_host: bool, slots: np.ndarray, gpu: GPULoadStoreSpec) -> bool:
        blocks = np.asarray(gpu.block_ids, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) != len(blocks):
            raise ValueError(
                f"hicache: job {job_id} pairs {len(slots)} host slots with {len(blocks)} blocks "
                "(one KV cache group and one block per offloaded chunk are supported)"
            )
        ours = self.mover.submit(to_host, slots, blocks, self._stream())
        self._jobs[ours] = (job_id, len(blocks) * self.mover.page_bytes, time.perf_counter())
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, HicacheLoadStoreSpec)
        return self._submit(job_id, True, dst_spec.block_ids, src_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, HicacheLoadStoreSpec)
        return self._submit(job_id, False, src_spec.block_ids, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        now = time.perf_counter()
        for ours, ok in self.mover.finished():
            job, size, start = self._jobs.pop(ours)
            self._done.append(TransferResult(job, ok, size, now - start))
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        ours = [o for o, (job, _, _) in self._jobs.items() if job in job_ids]
        self.mover.wait(ours)


class HicacheOffloadingSpec(OffloadingSpec):
    """The spec vLLM loads by name (``spec_name``) from ``spec_module_path="hicache.vllm"``."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {
            metric_name(k): OffloadingCounterMetadata(documentation=d) for k, d in METRIC_COUNTERS.items()
        }
        defs.update(
            {metric_name(k): OffloadingGaugeMetadata(documentation=d) for k, d in METRIC_GAUGES.items()}
        )
        return defs

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if len(config.groups) != 1:
            raise ValueError(
                f"hicache: this model has {len(config.groups)} KV cache groups; hicache's vLLM spec "
                "supports one (full attention or MLA models)"
            )
        if self.blocks_per_chunk != 1:
            raise ValueError(
                f"hicache: offloaded chunks of {self.blocks_per_chunk} blocks; set the offloaded "
                "block size to vLLM's block size"
            )
        extra = config.extra_config
        self.num_slots = _slots(config)
        self.eviction = str(extra.get("eviction", "leaf-first"))
        self.admission = str(extra.get("admission", "adaptive"))
        for name, value, allowed in (
            ("eviction", self.eviction, ("leaf-first", "lru")),
            ("admission", self.admission, ("adaptive", "second-sighting", "always")),
        ):
            if value not in allowed:
                raise ValueError(f"hicache: {name} must be one of {', '.join(allowed)}, not {value!r}")
        self.shared = bool(extra.get("shared_memory", False))
        # One region written by rank 0 and read by all when every rank holds the same bytes.
        self.replicated_layout = bool(config.replicated_layout and self.shared)
        self._manager: HicacheManager | None = None
        self._worker: HicacheWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            if self.num_slots < 1:
                raise ValueError("hicache: vLLM gave no KV block size, so host_bytes cannot be sized")
            self._manager = HicacheManager(
                self.num_slots, self.eviction, self.admission, self.kv_events_config.enable_kv_cache_events
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            name, owner, create = None, "", True
            if self.shared:
                parallel = self.config.parallel
                rank = 0 if self.replicated_layout else parallel.rank
                name = f"hicache-{self.config.engine_id}-{rank}"
                owner = engine_owner(self.config.engine_id, parallel.world_size)
                create = rank == parallel.rank  # replicated: rank 0 creates, the others attach
            self._worker = HicacheWorker(kv_caches, self.num_slots, name, owner, create)
        return self._worker
