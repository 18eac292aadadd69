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
wait for the network except for a host miss's bounded fetch. When the store fails (its master
down or restarting), every call fails at once, as a counted miss, without touching the client,
except one one-name call every ``retry_s`` seconds that looks whether it answers again: the
engine never waits on a dead master and the client's log gets a line or two a retry, not one per
page. The client finds a restarted master by itself (0.2-0.4 s after it listens again, measured
on a 2-core host); hicache never replaces or closes a client while the tier is in use: making
one blocks the whole process while the master is unreachable (the client's setup retries for
~90 s holding the GIL), and closing one under a call still running in it crashed the process.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any

from ._core import TIER_FAILED, TIER_MISSING, Tier

# Mooncake Store's error codes for a key it does not have, and for a read whose lease (the time
# the master holds the object for it) ran out before its transfer ended: the object is still
# there, so that read is tried once more, and neither means the store is down.
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


_PROBE = "hicache-probe"  # a name nobody writes: a call that must answer "not found"


def _address(url_or_hostport: str) -> tuple[str, int] | None:
    """(host, port) of "host:port" or "http://host:port/...", None for anything else."""
    rest = url_or_hostport.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def _reachable(address: str, timeout_s: float) -> str | None:
    """None if a TCP connection to `address` opens within timeout_s, else why not."""
    hp = _address(address)
    if hp is None:
        return None  # not host:port (etcd://..., P2PHANDSHAKE): let the client judge
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            return None
    except OSError as e:
        return f"{hp[0]}:{hp[1]}: {e.strerror or e}"


class MooncakeTier(Tier):
    """A :class:`hicache.Tier` over a Mooncake Store client.

    Args:
        master: the master's ``host:port``.
        metadata: the metadata service's URL (the master's own HTTP one, or etcd's).
        hostname: this host's address as other clients reach it.
        segment_bytes: host memory this client lends to the store.
        protocol: ``"tcp"`` (any network) or ``"rdma"`` (with ``rdma_devices``).
        retry_s: while the store fails, how often a one-name call looks whether it answers
            again (every other call fails at once meanwhile, counted as a miss or a failed page).

    Raises:
        TierUnavailableError: the client is not installed, or the store cannot be reached (the
            master's and the metadata service's ports are tried first, 2 s each, so that an
            unreachable store fails at once instead of after the client's ~90 s of retries).
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
        retry_s: float = 1.0,
    ) -> None:
        super().__init__()
        cls = _client_class()
        if isinstance(retry_s, bool) or not isinstance(retry_s, (int, float)) or not 0 < retry_s <= 3600:
            raise ValueError(f"retry_s must be a number of seconds in (0, 3600], not {retry_s!r}")
        for what, address in (("master", master), ("metadata service", metadata)):
            why = _reachable(address, 2.0)
            if why is not None:
                raise TierUnavailableError(f"cannot reach Mooncake Store's {what} at {why}")
        self._retry_s = float(retry_s)
        self._regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        # Two threads, so that a put and a get (a cache keeps at most one of each in flight) each
        # have one; the client serves them one after the other all the same (a one-page get
        # issued during a 64 MiB put waited 24-35 ms with one thread, 35-37 ms with two), which is
        # why this is not an option.
        self._thread = ThreadPoolExecutor(2, thread_name_prefix="hicache-mooncake")
        self._batches: dict[int, tuple[Future[list[int]], int]] = {}
        self._next = 1
        self._closed = False
        self._down_since: float | None = None  # monotonic time of the first failure of an outage
        self._next_retry = 0.0
        self.outages = 0  # times the store stopped answering
        self.last_error = ""  # the client's last failure, one line
        store = cls()
        try:
            rc = store.setup(hostname, metadata, int(segment_bytes), 16 << 20, protocol, rdma_devices, master)
        except Exception as e:
            raise TierUnavailableError(f"Mooncake Store client setup failed: {e}") from e
        if rc != 0:
            raise TierUnavailableError(
                f"cannot reach Mooncake Store (master {master}, metadata {metadata}): setup returned {rc}"
            )
        self._store: Any = store

    # --- health -------------------------------------------------------------------------------

    def _may_call(self) -> bool:
        """Whether a call may go to the client: always while the store answers; during an
        outage only when a retry is due, and then a one-name probe goes first."""
        with self._lock:
            if self._closed:
                return False
            if self._down_since is None:
                return True
            now = time.monotonic()
            if now < self._next_retry:
                return False
            self._next_retry = now + self._retry_s  # this thread retries; others fail meanwhile
        try:
            answered = list(self._store.batch_is_exist([_PROBE]))
        except Exception:  # noqa: BLE001 - a failed probe is the outage going on
            answered = [TIER_FAILED]
        if (answered and answered[0] >= 0) or answered == [_OBJECT_NOT_FOUND]:
            with self._lock:
                self._down_since = None
            return True
        return False

    def _note(self, call: str, r: list[int]) -> None:
        bad = [x for x in r if x < 0 and x not in (_OBJECT_NOT_FOUND, _LEASE_EXPIRED)]
        if not bad:
            return
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
                self._next_retry = self._down_since + self._retry_s
                self.outages += 1
            self.last_error = f"{call}: code {bad[0]} for {len(bad)} of {len(r)} names"

    def _call(self, call: str, n: int, *args: Any) -> list[int]:
        """The client's own codes, n of them (all failed if the call raised, miscounted, or the
        store is down and no retry is due)."""
        if not self._may_call():
            return [TIER_FAILED] * n
        try:
            r = list(getattr(self._store, call)(*args))
        except Exception as e:  # noqa: BLE001 - a failed call is a failed batch, never the engine's error
            r = [TIER_FAILED] * n
            with self._lock:
                self.last_error = f"{call}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if len(r) != n:
            r = [TIER_FAILED] * n
        self._note(call, r)
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
            if self._closed:  # after close(): a batch that failed, not an exception in the engine
                fut: Future[list[int]] = Future()
                fut.set_result([TIER_FAILED] * n)
            else:
                fut = self._thread.submit(fn)
            self._batches[batch] = (fut, n)
        return batch

    # --- the Tier interface ---------------------------------------------------------------------

    def name(self) -> str:
        return "mooncake"

    def use_memory(self, addr: int, size: int) -> None:
        """Registers host memory hicache puts values from or gets them into (zero-copy)."""
        with self._lock:
            self._regions.append((addr, size))
            store = None if self._closed else self._store
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
            store = None if self._closed else self._store
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
        """Stop the client (after the caches using it are gone): calls still running end first;
        later ones fail at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._thread.shutdown(wait=True)
        self._store.close()
