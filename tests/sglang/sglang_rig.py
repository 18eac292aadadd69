"""SGLang's own HiCache machinery on the CPU, for driving a storage backend as SGLang does.

Everything here is SGLang 0.5.23's code: its device KV pools, its host pools (unpinned: there is
no GPU to pin for), its paged allocator and its HiCacheController with the storage threads that
back pages up (write_storage -> batch_set_v1) and prefetch them (prefetch -> batch_exists ->
batch_get_v1). The rig only stands in for the scheduler's two hand-offs: it allocates the host
slots a storage hit lands in and puts the operation in the controller's prefetch buffer, as the
radix tree does (UnifiedRadixCache._drain_and_alloc_storage_hit).
"""

from __future__ import annotations

import os
import socket
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

PAGE = 4  # tokens a page (the tests' shape)
MODULE = "hicache.sglang"


@dataclass(frozen=True)
class Shape:
    """A model's KV shape and the pools' sizes. The tests' default is tiny; bench/sglang_backend.py
    uses an 8B-shaped one."""

    page: int = PAGE
    layers: int = 3
    heads: int = 2  # MHA: KV heads of this rank; MLA: unused
    head_dim: int = 8
    tokens: int = 256  # the device pool's; the host pool holds twice as many


def start_sglang() -> None:
    """A one-process gloo group and a published (CPU) server config, once per process."""
    if dist.is_initialized():
        return
    with socket.socket() as s:  # a free port: two runs on one machine never share one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    runtime_context.publish(
        ServerArgs(model_path="dummy", device="cpu"),
        role="scheduler",
        ranks=runtime_context.SpawnRanks(world_rank=0),
    )


def hicache_config(**options: Any) -> dict[str, Any]:
    return {
        "backend_name": "hicache",
        "module_path": MODULE,
        "class_name": "HicacheStorage",
        "interface_v1": 1,
        **options,
    }


@dataclass
class Rig:
    controller: Any
    host: Any
    kind: str
    page: int

    @property
    def backend(self) -> Any:
        b = self.controller.storage_backend
        return getattr(b, "_backend", b)  # SGLang's failure injector wraps it when asked to

    def close(self) -> None:
        self.controller.detach_storage_backend()
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()


def mha_pools(shape: Shape, layout: str, dtype: torch.dtype = torch.float16) -> tuple[Any, Any]:
    """SGLang's MHA device pool (on the CPU) and its host pool (unpinned)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(
        shape.tokens,
        shape.page,
        dtype,
        shape.heads,
        shape.head_dim,
        shape.layers,
        "cpu",
        False,
        start_layer=0,
        end_layer=shape.layers,
    )
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        shape.page,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=shape.layers,
    )
    return device, host


def make_rig(
    kind: str = "mha",
    layout: str = "layer_first",
    backend: str = "dynamic",
    extra: dict[str, Any] | None = None,
    *,
    model: str = "tiny-llama",
    dtype: torch.dtype = torch.float16,
    metrics: bool = False,
    shape: Shape = Shape(),
) -> Rig:
    start_sglang()
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    if kind == "mha":
        device, host = mha_pools(shape, layout, dtype)
    elif kind == "mla":
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        device = MLATokenToKVPool(
            shape.tokens,
            shape.page,
            dtype,
            32,
            8,
            shape.layers,
            "cpu",
            False,
            start_layer=0,
            end_layer=shape.layers,
        )
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            shape.page,
            layout,
            pin_memory=False,
            device_capacity_tokens=device.size,
            start_layer=0,
            end_layer=shape.layers,
            override_kv_cache_dim=device.kv_cache_dim,
            target_layer_num=shape.layers,
        )
    else:
        raise ValueError(kind)
    allocator = PagedTokenToKVPoolAllocator(shape.tokens, shape.page, dtype, "cpu", device, False)
    controller = HiCacheController(
        allocator,
        host,
        shape.page,
        dist.group.WORLD,
        threading.Event(),
        io_backend="direct",
        storage_backend=backend,
        model_name=model,
        storage_backend_extra_config=dict(extra) if extra is not None else hicache_config(tier="memory"),
        enable_storage_metrics=metrics,
    )
    return Rig(controller, host, kind, shape.page)


def page_hashes(tokens: list[int], last_hash: str | None = None, page: int = PAGE) -> list[str]:
    """SGLang's storage keys for the pages of `tokens` (its own chained SHA-256)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, last_hash, page_size=page)


def pages_of(rig: Rig, host_indices: torch.Tensor) -> list[bytes]:
    """Each page's bytes as SGLang's host pool gives them (get_data_page)."""
    out = []
    for i in range(0, host_indices.numel(), rig.page):
        page = rig.host.get_data_page(int(host_indices[i]), flat=True)
        out.append(page.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def fill_random(rig: Rig, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    buf = rig.host.kv_buffer.view(torch.uint8)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))


def write_storage(
    rig: Rig, slots: torch.Tensor, tokens: list[int], prefix_keys: list[str] | None = None
) -> list[str]:
    """SGLang's backup thread writes the pages of `tokens` in host `slots` through the backend
    (write_storage until its ack); returns their keys."""
    hashes = page_hashes(tokens, prefix_keys[-1] if prefix_keys else None, rig.page)
    rig.controller.write_storage(slots, tokens, hash_value=hashes, prefix_keys=list(prefix_keys or []))
    op = rig.controller.ack_backup_queue.get(timeout=600)
    assert op.completed_tokens == len(tokens), f"backed up {op.completed_tokens} of {len(tokens)} tokens"
    return hashes


def fetch(
    rig: Rig,
    tokens: list[int],
    rid: str,
    last_hash: str | None = None,
    prefix_keys: list[str] | None = None,
    *,
    scrub: bool = True,
) -> tuple[int, torch.Tensor | None]:
    """SGLang's prefetch of `tokens`: its prefetch thread asks the backend which pages exist,
    the rig allocates host slots for the hit as the scheduler does, SGLang's I/O thread reads
    them. Returns the tokens SGLang counts as loaded and the slots (None on a miss)."""
    cc = rig.controller
    cc.prefetch(rid, tokens, last_hash, prefix_keys=prefix_keys)
    op = cc.prefetch_hit_queue.get(timeout=600)
    if op.storage_hit_count == 0:
        return 0, None
    slots = rig.host.alloc(op.storage_hit_count)
    assert slots is not None
    if scrub:
        # Fresh bytes everywhere first: slots handed out again still hold what was backed up
        # from them, which would pass for a load that never happened.
        fill_random(rig, seed=zlib.crc32(rid.encode()))
    op.host_indices = slots
    cc.prefetch_buffer.put(op)
    completed = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=600)
        if ack.completed_tokens is not None:
            completed = max(completed, ack.completed_tokens)
        if ack.completed_req:
            return completed, slots


def backup(
    rig: Rig, tokens: list[int], seed: int, prefix_keys: list[str] | None = None
) -> tuple[list[str], list[bytes]]:
    """Pages of `tokens` with random bytes in fresh host slots, backed up by SGLang's backup
    thread; returns their keys and bytes."""
    slots = rig.host.alloc(len(tokens))
    assert slots is not None
    g = torch.Generator().manual_seed(seed)
    for i in range(0, len(tokens), rig.page):
        page = rig.host.get_dummy_flat_data_page()
        raw = page.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        rig.host.set_from_flat_data_page(int(slots[i]), page)
    written = pages_of(rig, slots)
    hashes = write_storage(rig, slots, tokens, prefix_keys)
    rig.host.free(slots)
    return hashes, written


def prefetch(
    rig: Rig, tokens: list[int], rid: str, last_hash: str | None = None, prefix_keys: list[str] | None = None
) -> tuple[int, list[bytes]]:
    """fetch(), then the bytes of the pages SGLang counts as loaded."""
    completed, slots = fetch(rig, tokens, rid, last_hash, prefix_keys)
    if slots is None:
        return 0, []
    got = pages_of(rig, slots[:completed])
    rig.host.free(slots)
    return completed, got
