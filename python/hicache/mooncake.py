"""Mooncake Store as hicache's shared tier: engines on several hosts reuse each other's pages.

``pip install hicache[mooncake]`` installs the store's client (PyPI
``mooncake-transfer-engine-non-cuda``, which also ships ``mooncake_master``; on GPU hosts the CUDA
build ``mooncake-transfer-engine`` works the same). Start one master for the deployment::

    mooncake_master -rpc_address 0.0.0.0 -rpc_port 50051 -enable_http_metadata_server=true \\
        -http_metadata_server_host 0.0.0.0 -http_metadata_server_port 8080

and give every engine's cache a tier::

    tier = MooncakeTier(master="10.0.0.1:50051", metadata="http://10.0.0.1:8080/metadata",
                        hostname="10.0.0.7", segment_bytes=64 << 30)
    cache = hicache.HostPrefixCache(kv, capacity_pages=..., tier=tier, tier_space="llama3-8b/tp0")

Each client lends ``segment_bytes`` of its host's memory to the store; values live in the
segments of all clients. Every value hicache writes carries a record (tokens, parent key, salt
digest, model space, checksum) that the reader checks, so a stale, truncated, foreign or
overwritten value is a miss, never served (see ``docs/tier.md``).

Calls run on threads of the tier's own (the store's client blocks), so hicache's callers never
wait for the network except for a host miss's bounded fetch. After a failed call the tier
reconnects by itself (a new client, hicache's memory registered again), at most once every
``reconnect_s`` seconds.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any

from ._core import TIER_FAILED, TIER_MISSING, Tier

# Mooncake Store's error codes for a key it does not have, and for a read whose lease (the time
# the master holds the object for it) ran out before its transfer ended: the object is still
# there, so that read is tried once more, and neither is a reason to reconnect.
_OBJECT_NOT_FOUND = -704
_LEASE_EXPIRED = -707


class TierUnavailableError(RuntimeError):
    """The tier's backend is not installed or cannot be reached."""


def _client_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise TierUnavailableError(
            "the Mooncake Store client is not installed: pip install 'hicache[mooncake]' "
            f"(PyPI mooncake-transfer-engine-non-cuda, or its CUDA build); import failed: {e}"
        ) from e
    return MooncakeDistributedStore


class MooncakeTier(Tier):
    """A :class:`hicache.Tier` over a Mooncake Store client.

    Args:
        master: the master's ``host:port``.
        metadata: the metadata service's URL (the master's own HTTP one, or etcd's).
        hostname: this host's address as other clients reach it.
        segment_bytes: host memory this client lends to the store.
        protocol: ``"tcp"`` (any network) or ``"rdma"`` (with ``rdma_devices``).
        reconnect_s: the least time between two reconnection attempts.

    Raises:
        TierUnavailableError: the client is not installed, or it cannot reach the store.
    """

    def __init__(
        self,
        master: str = "127.0.0.1:50051",
        metadata: str = "http://127.0.0.1:8080/metadata",
        *,
        hostname: str = "127.0.0.1",
        segment_bytes: int = 1 << 30,
        protocol: str = "tcp",
        rdma_devices: str = "",
        reconnect_s: float = 1.0,
    ) -> None:
        super().__init__()
        self._cls = _client_class()
        self._args = (hostname, metadata, int(segment_bytes), 16 << 20, protocol, rdma_devices, master)
        self._reconnect_s = reconnect_s
        self._regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        # Two threads, so that a put and a get (a cache keeps at most one of each in flight) each
        # have one; the client serves them one after the other all the same (a one-page get
        # issued during a 64 MiB put waited 24-35 ms with one thread, 35-37 ms with two), which is
        # why this is not an option.
        self._thread = ThreadPoolExecutor(2, thread_name_prefix="hicache-mooncake")
        self._batches: dict[int, tuple[Future[list[int]], int]] = {}
        self._next = 1
        self._store: Any = None
        self._last_attempt = 0.0
        self.reconnects = 0
        if not self._connect():
            raise TierUnavailableError(f"cannot reach Mooncake Store (master {master}, metadata {metadata})")

    # --- connection ---------------------------------------------------------------------------

    def _connect(self) -> bool:
        self._last_attempt = time.monotonic()
        store = self._cls()
        try:
            if store.setup(*self._args) != 0:
                return False
            with self._lock:
                regions = list(self._regions)
            for addr, size in regions:
                if store.register_buffer(addr, size) != 0:
                    return False
        except Exception:  # noqa: BLE001 - any failure of the client's setup means "not connected"
            return False
        old, self._store = self._store, store
        if old is not None:
            try:
                old.close()
            except Exception:  # noqa: BLE001 - the old client is gone either way
                pass
        return True

    def _failed(self) -> None:
        # Reconnect by itself, not more often than reconnect_s (a dead master must not turn
        # every call into a reconnection storm).
        if time.monotonic() - self._last_attempt >= self._reconnect_s and self._connect():
            self.reconnects += 1

    def _call(self, call: str, n: int, *args: Any) -> list[int]:
        """The client's own codes, n of them (all failed if the call raised or miscounted)."""
        store = self._store
        try:
            r = list(getattr(store, call)(*args))
        except Exception:  # noqa: BLE001 - a failed call is a failed batch, never the engine's error
            r = [TIER_FAILED] * n
        if len(r) != n:
            r = [TIER_FAILED] * n
        if any(x < 0 and x not in (_OBJECT_NOT_FOUND, _LEASE_EXPIRED) for x in r):
            self._failed()
        return r

    @staticmethod
    def _codes(r: list[int]) -> list[int]:
        return [TIER_MISSING if x == _OBJECT_NOT_FOUND else (TIER_FAILED if x < 0 else x) for x in r]

    def _run(self, call: str, n: int, *args: Any) -> list[int]:
        return self._codes(self._call(call, n, *args))

    def _submit(self, fn: Any, n: int) -> int:
        with self._lock:
            batch = self._next
            self._next += 1
            self._batches[batch] = (self._thread.submit(fn), n)
        return batch

    # --- the Tier interface ---------------------------------------------------------------------

    def name(self) -> str:
        return "mooncake"

    def use_memory(self, addr: int, size: int) -> None:
        """Registers host memory hicache puts values from or gets them into (zero-copy)."""
        with self._lock:
            self._regions.append((addr, size))
            store = self._store
        rc = store.register_buffer(addr, size) if store is not None else -1
        if rc != 0:
            raise TierUnavailableError(
                f"Mooncake Store refused to register {size} bytes of hicache's memory at {addr:#x}: {rc}"
            )

    def release_memory(self, addr: int, size: int) -> None:
        with self._lock:
            if (addr, size) not in self._regions:
                return
            self._regions.remove((addr, size))
            store = self._store
        if store is not None:
            store.unregister_buffer(addr)

    def put(self, names: list[str], values: list[int], sizes: list[int]) -> int:
        def run() -> list[int]:
            # Upsert: a value a failed writer left behind is replaced, not kept.
            r = self._run("batch_upsert_from", len(names), names, values, sizes)
            return [s if x >= 0 else x for x, s in zip(r, sizes, strict=True)]

        return self._submit(run, len(names))

    def get(self, names: list[str], dests: list[int], capacity: int) -> int:
        def run() -> list[int]:
            r = self._call("batch_get_into", len(names), names, dests, [capacity] * len(names))
            again = [i for i, x in enumerate(r) if x == _LEASE_EXPIRED]
            if again:  # a long batch outlived the lease of some reads: those once more
                retry = self._call(
                    "batch_get_into",
                    len(again),
                    [names[i] for i in again],
                    [dests[i] for i in again],
                    [capacity] * len(again),
                )
                for i, x in zip(again, retry, strict=True):
                    r[i] = x
            return self._codes(r)

        return self._submit(run, len(names))

    def exists(self, names: list[str]) -> int:
        return self._submit(lambda: self._run("batch_is_exist", len(names), names), len(names))

    def wait(self, batch: int, timeout_s: float) -> bool:
        """Blocks (without the GIL) until the batch is done or ``timeout_s`` passed: hicache
        polls a tier that cannot, and polling this one thousands of times a second slowed the
        client's own transfers (see ``hicache.Tier.wait``)."""
        with self._lock:
            entry = self._batches.get(batch)
        if entry is not None:
            wait_for([entry[0]], timeout=timeout_s)
        return True

    def poll(self, batch: int) -> list[int] | None:
        with self._lock:
            fut, n = self._batches[batch]
            if not fut.done():
                return None
            del self._batches[batch]
        try:
            return fut.result()
        except Exception:  # noqa: BLE001 - as in _run
            return [TIER_FAILED] * n

    def close(self) -> None:
        """Stop the client (after the caches using it are gone)."""
        self._thread.shutdown(wait=True)
        if self._store is not None:
            self._store.close()
            self._store = None
