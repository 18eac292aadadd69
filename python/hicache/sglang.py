"""SGLang HiCache storage backend: SGLang's L3 in a hicache tier (``docs/sglang.md``).

SGLang's hierarchical cache keeps KV pages in GPU memory and in a host pool of its own; a storage
backend is its third level, which SGLang's cache controller backs pages up to (``batch_set_v1``)
and prefetches them from (``batch_exists``, ``batch_get_v1``) by page hash. This backend puts
those pages in a hicache tier (a disk directory that survives restarts, Mooncake Store shared by
hosts, or process memory), each one as hicache's checked value: the page's pieces gathered from
SGLang's host pool, then a record of its key, its parent's key and the space (model, pool class,
dtype, layout, page size, rank), and a checksum. A page written by another model, layout or
rank, one read as the continuation of another prefix, a damaged, truncated or missing value is a
miss in SGLang's accounting, never bytes in its pool.

Launch (the zero-copy calls need ``interface_v1``; the parent check needs
``hicache_storage_pass_prefix_keys``)::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "hicache", "module_path": "hicache.sglang", "class_name": "HicacheStorage",
          "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
          "tier": "disk", "path": "/var/cache/hicache-sglang", "capacity_bytes": 500000000000}'
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from ._core import MemoryTier, PageStore, Tier
from .disk_tier import DiskTier

try:  # where 0.5.23 keeps it
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError:  # pragma: no cover - other releases
    StorageMetrics = None

logger = logging.getLogger(__name__)

__all__ = ["HicacheStorage", "page_pieces"]

# Keys SGLang itself reads from the extra config (the dynamic loader's, the zero-copy switch).
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
_OWN_KEYS = frozenset(
    {
        "tier",
        "path",
        "capacity_bytes",
        "space",
        "timeout_s",
        "mooncake_master",
        "mooncake_metadata",
        "mooncake_hostname",
        "mooncake_segment_bytes",
        "mooncake_protocol",
        "mooncake_rdma_devices",
    }
)
_TIERS = ("disk", "mooncake", "memory")


def _rank_label(config: HiCacheStorageConfig) -> str:
    """The part of the space (and of the disk directory) that tells ranks' shards apart.

    MLA KV is the same on every tensor-parallel rank (SGLang writes it from one rank and every
    rank reads it), so it is named without the TP rank; other KV is each rank's own heads.
    """
    tp = "tp-any" if config.is_mla_model else f"tp{config.tp_rank}of{config.tp_size}"
    parts = [tp, f"pp{config.pp_rank}of{config.pp_size}"]
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
    if config.dcp_size > 1:
        parts.append(f"dcp{config.dcp_rank}of{config.dcp_size}")
    return "-".join(parts)


def page_pieces(pool: Any, host_indices: torch.Tensor) -> tuple[list[int], list[int]]:
    """Where each page of `host_indices` lies in SGLang's host pool: (addresses, bytes), piece by
    piece, page after page (the pool's own ``get_page_buffer_meta``, as SGLang's zero-copy
    backends use it)."""
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    if ptrs and isinstance(ptrs[0], Sequence):  # some pools group a page's pieces
        ptrs = [p for page in ptrs for p in page]
        sizes = [s for page in sizes for s in page]
    return [int(p) for p in ptrs], [int(s) for s in sizes]


class HicacheStorage(HiCacheStorage):
    """A :class:`sglang.srt.mem_cache.hicache_storage.HiCacheStorage` over a hicache tier.

    Loaded by SGLang's storage factory (``--hicache-storage-backend dynamic``) as
    ``HicacheStorage(storage_config, kwargs)``. Options, in the extra config:

    - ``tier``: ``"disk"`` (default), ``"mooncake"`` or ``"memory"`` (tests: this process only,
      unbounded, never evicts).
    - ``path`` and ``capacity_bytes`` (disk): the directory (each rank writes a subdirectory of
      its own: a directory has one writer) and the bytes its segment files may hold.
    - ``mooncake_master``, ``mooncake_metadata``, ``mooncake_hostname``,
      ``mooncake_segment_bytes``, ``mooncake_protocol``, ``mooncake_rdma_devices`` (mooncake).
    - ``space``: a name of your own added to the space (a model version, a quantization).
    - ``timeout_s``: how long one batch may take in the tier before its pages fail (30).

    Raises:
        ValueError: an unknown option or a bad value, named. ``NotImplementedError``: MLA on the
        disk tier with several tensor-parallel ranks (one rank writes, the others could not open
        its directory: use Mooncake), or a host pool that cannot say where a page lies (no
        ``get_page_buffer_meta``).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - _SGLANG_KEYS - _OWN_KEYS)
        if unknown:
            raise ValueError(
                f"hicache.sglang: unknown extra-config key(s) {unknown}; known: {sorted(_OWN_KEYS)}"
            )
        self.storage_config = storage_config
        # SGLang's controller calls the zero-copy v1 calls with interface_v1 set, else the
        # generic ones with flat page tensors; the two store pages in different spaces (their
        # bytes are ordered differently), so existence is asked of the one in use.
        self._zero_copy = bool(extra.get("interface_v1", 0))
        self._tier_kind = extra.get("tier", "disk")
        if self._tier_kind not in _TIERS:
            raise ValueError(f"hicache.sglang: tier must be one of {list(_TIERS)}, not {self._tier_kind!r}")
        self._user_space = str(extra.get("space", ""))
        timeout_s = extra.get("timeout_s", 30.0)
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not 0 < timeout_s <= 3600
        ):
            raise ValueError(f"hicache.sglang: timeout_s must be seconds in (0, 3600], not {timeout_s!r}")
        self._timeout_s = float(timeout_s)
        self.tier = self._open_tier(extra, storage_config)
        self._stores: dict[str, PageStore] = {}
        self._flat: PageStore | None = None
        self._metrics = storage_config.enable_storage_metrics and StorageMetrics is not None
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []

    # --- set-up ---------------------------------------------------------------------------------

    def _open_tier(self, extra: dict[str, Any], config: HiCacheStorageConfig) -> Tier:
        if self._tier_kind == "memory":
            logger.warning(
                "hicache.sglang: tier 'memory' keeps every page in this process, unbounded and never "
                "evicted (meant for tests); use 'disk' or 'mooncake' to serve"
            )
            return MemoryTier()
        if self._tier_kind == "mooncake":
            from .mooncake import MooncakeTier

            return MooncakeTier(
                extra.get("mooncake_master", "127.0.0.1:50051"),
                extra.get("mooncake_metadata", "http://127.0.0.1:8080/metadata"),
                hostname=extra.get("mooncake_hostname", "127.0.0.1"),
                segment_bytes=extra.get("mooncake_segment_bytes", 1 << 30),
                protocol=extra.get("mooncake_protocol", "tcp"),
                rdma_devices=extra.get("mooncake_rdma_devices", ""),
            )
        if "path" not in extra or "capacity_bytes" not in extra:
            raise ValueError("hicache.sglang: the disk tier needs 'path' and 'capacity_bytes'")
        if config.is_mla_model and config.tp_size > 1:
            raise NotImplementedError(
                "hicache.sglang: MLA with several tensor-parallel ranks on the disk tier: SGLang "
                "writes MLA pages from one rank for all, and a disk directory has one writer; "
                "use tier 'mooncake'"
            )
        path = os.path.join(os.fspath(extra["path"]), _rank_label(config))
        return DiskTier(path, extra["capacity_bytes"])

    def _space(self, pool: Any, name: str, flat: bool) -> str:
        c = self.storage_config
        what = [
            "sglang",
            c.model_name or "",
            self._user_space,
            str(name),
            type(pool).__name__,
            str(getattr(pool, "dtype", "")),
            str(getattr(pool, "layout", "")),
            f"page{getattr(pool, 'page_size', 1)}",
            f"layers{getattr(pool, 'layer_num', '')}",
            _rank_label(c),
            "flat" if flat else "pieces",
        ]
        return "/".join(what)

    def _store_for(self, pool: Any, name: str) -> PageStore:
        if not callable(getattr(pool, "get_page_buffer_meta", None)):
            raise NotImplementedError(
                f"hicache.sglang: SGLang's {type(pool).__name__} does not say where a page lies "
                "(no get_page_buffer_meta); the backend stores MHA and MLA host pools"
            )
        page = getattr(pool, "page_size", 1) or 1
        _, sizes = page_pieces(pool, torch.arange(page, dtype=torch.int64))
        return PageStore(self.tier, self._space(pool, name, False), sizes, self._timeout_s)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._stores[PoolName.KV.value] = self._store_for(mem_pool_host, PoolName.KV.value)
        flat = mem_pool_host.get_dummy_flat_data_page()
        self._flat_bytes = flat.numel() * flat.element_size()
        self._flat = PageStore(
            self.tier,
            self._space(mem_pool_host, PoolName.KV.value, True),
            [self._flat_bytes],
            self._timeout_s,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's other pools (SWA windows, Mamba states, ...), stored beside the KV
        pages under the same page keys, each pool in a space of its own."""
        name = str(host_pool_name)
        if name != PoolName.KV.value:
            self._stores[name] = self._store_for(host_pool, name)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    # --- the zero-copy calls (interface_v1) -----------------------------------------------------

    def _kv(self) -> PageStore:
        store = self._stores.get(PoolName.KV.value)
        if store is None:
            raise RuntimeError("hicache.sglang: no host pool registered (register_mem_pool_host)")
        return store

    @staticmethod
    def _parent(extra_info: HiCacheStorageExtraInfo | None) -> str | None:
        """keys[0]'s parent: the last of the prefix keys ("" at a chain's start), or None where
        SGLang does not pass them (hicache_storage_pass_prefix_keys off)."""
        if extra_info is None or extra_info.prefix_keys is None:
            return None
        return extra_info.prefix_keys[-1] if extra_info.prefix_keys else ""

    def _pieces(
        self, keys: list[str], host_indices: torch.Tensor, pool: Any = None, store: PageStore | None = None
    ) -> list[int]:
        pool = self.mem_pool_host if pool is None else pool
        store = self._kv() if store is None else store
        ptrs, _ = page_pieces(pool, host_indices)
        if len(ptrs) != len(keys) * store.pieces:
            raise ValueError(
                f"hicache.sglang: {len(ptrs)} pieces for {len(keys)} keys "
                f"({store.pieces} a page): host_indices of {host_indices.numel()} tokens"
            )
        return ptrs

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        store = self._kv() if self._zero_copy else self._flat_store()
        found = store.exists(list(keys))
        return found.index(False) if False in found else len(found)

    @staticmethod
    def _put_missing(store: PageStore, keys: list[str], parent: str | None, ptrs: list[int]) -> list[bool]:
        """Writes the pages the tier lacks (a disk would append a page it holds twice), each run of
        them as one chained batch; per page, whether the tier holds it now."""
        per = store.pieces
        have = store.exists(keys)
        out = list(have)
        i = 0
        while i < len(keys):
            if have[i]:
                parent = keys[i]
                i += 1
                continue
            j = i
            while j < len(keys) and not have[j]:
                j += 1
            out[i:j] = store.put(keys[i:j], parent, ptrs[i * per : j * per])
            parent = keys[j - 1]
            i = j
        return out

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        keys = list(keys)
        if not keys:
            return []
        start = time.perf_counter()
        out = self._put_missing(self._kv(), keys, self._parent(extra_info), self._pieces(keys, host_indices))
        if self._metrics:
            self._note(self._backup_pgs, self._backup_bw, len(keys), start)
        return out

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        keys = list(keys)
        if not keys:
            return []
        start = time.perf_counter()
        out = self._kv().get(keys, self._parent(extra_info), self._pieces(keys, host_indices))
        if self._metrics:
            self._note(self._prefetch_pgs, self._prefetch_bw, len(keys), start)
        return out

    # --- the per-pool calls (v2: hybrid models' pools beside the KV pages) ---------------------

    def _pool_io(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None, write: bool
    ) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for t in transfers:
            name, keys = str(t.name), list(t.keys or [])
            store = self._stores.get(name)
            pool = getattr(self, "registered_pools", {}).get(
                t.name, self.mem_pool_host if name == "kv" else None
            )
            page = getattr(pool, "page_size", 1) or 1
            if (
                store is None
                or pool is None
                or t.host_indices is None
                or t.host_indices.numel() != len(keys) * page
            ):
                logger.error(
                    "hicache.sglang: pool %s: no store, or %s indices for %d keys",
                    name,
                    None if t.host_indices is None else t.host_indices.numel(),
                    len(keys),
                )
                results[name] = [False] * len(keys)
                continue
            if not keys:
                results[name] = []
                continue
            ptrs = self._pieces(keys, t.host_indices, pool, store)
            parent = self._parent(extra_info)
            results[name] = (
                self._put_missing(store, keys, parent, ptrs) if write else store.get(keys, parent, ptrs)
            )
        return results

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._pool_io(transfers, extra_info, write=True)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._pool_io(transfers, extra_info, write=False)

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest prefix whose KV pages exist and whose other pools hold what their hit
        policy asks for (every page, or the last len(transfer.keys) pages), as SGLang's own file
        backend reckons it; pools of block groups (compressed KV) give no hit."""
        keys = list(keys)
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            name = str(t.name)
            store = self._stores.get(name)
            have = store.exists(keys[:kv_pages]) if store is not None else [False] * kv_pages
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = have.index(False) if False in have else kv_pages
                pool_ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                pool_ok = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - trailing) : n])}
            else:
                logger.warning(
                    "hicache.sglang: pool %s's hit policy %s is not supported: no hit", name, t.hit_policy
                )
                pool_ok = set()
            if pool_ok:
                hits[name] = max(pool_ok)
            restorable &= pool_ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    # --- the generic calls (flat page tensors; SGLang uses them without interface_v1) -----------

    def _flat_store(self) -> PageStore:
        if self._flat is None:
            raise RuntimeError("hicache.sglang: no host pool registered (register_mem_pool_host)")
        return self._flat

    def _check_flat(self, t: torch.Tensor, what: str) -> int:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"hicache.sglang: {what} must be a contiguous CPU tensor")
        if t.numel() * t.element_size() != self._flat_bytes:
            raise ValueError(
                f"hicache.sglang: {what} holds {t.numel() * t.element_size()} bytes, "
                f"not a page's {self._flat_bytes}"
            )
        return t.data_ptr()

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        ptrs = [self._check_flat(t, "target_location") for t in target_locations]
        ok = self._flat_store().get(list(keys), None, ptrs)
        return [t if good else None for t, good in zip(target_locations, ok, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        values = [v.contiguous() for v in values]
        store = self._flat_store()
        return all(store.put(list(keys), None, [self._check_flat(v, "value") for v in values]))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- operators ------------------------------------------------------------------------------

    def _note(self, pages: list[int], bandwidth: list[float], n: int, start: float) -> None:
        seconds = max(time.perf_counter() - start, 1e-9)
        pages.append(n)
        bandwidth.append(n * self._kv().page_bytes / seconds / 1e9)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages and GB/s of each prefetch and backup since the last
        call) when storage metrics are on; else None."""
        if not self._metrics:
            return None
        m = StorageMetrics()
        m.prefetch_pgs.extend(self._prefetch_pgs)
        m.backup_pgs.extend(self._backup_pgs)
        m.prefetch_bandwidth.extend(self._prefetch_bw)
        m.backup_bandwidth.extend(self._backup_bw)
        for pending in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw):
            pending.clear()
        return m

    def stats(self) -> dict[str, Any]:
        """hicache's own counters: per store (``kv``, ``kv-flat``) pages put, got, missing,
        rejected (failed the record or checksum check), tier errors; the disk tier's stats."""
        out: dict[str, Any] = {name: s.stats() for name, s in self._stores.items()}
        if self._flat is not None:
            out["kv-flat"] = self._flat.stats()
        if isinstance(self.tier, DiskTier):
            out["disk"] = self.tier.stats()
        return out

    def clear(self) -> bool:
        # A tier holds pages of other processes and spaces too; hicache never deletes them in
        # bulk (the disk tier evicts by capacity; remove its directory to start afresh).
        logger.warning("hicache.sglang: clear() is not supported; pages stay until evicted")
        return False

    def close(self) -> None:
        close = getattr(self.tier, "close", None)
        if callable(close):
            close()
