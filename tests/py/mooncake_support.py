"""A Mooncake Store master on 127.0.0.1 for the tests, and engine processes that use it.

The master (``mooncake_master`` from PyPI's mooncake-transfer-engine-non-cuda) runs with its own
HTTP metadata service on free ports and is stopped after each test that starts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


@dataclasses.dataclass
class Master:
    rpc: str  # host:port
    metadata: str  # URL
    process: subprocess.Popen[bytes]
    args: list[str]
    log: Path

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)

    def restart(self) -> None:
        """Start the master again on the same ports (after kill)."""
        self.process = _spawn(self.args, self.log)
        _wait_ports(self)


def master_binary() -> str:
    found = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not os.access(found, os.X_OK):
        raise FileNotFoundError("mooncake_master not found: pip install 'hicache[mooncake]'")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)


def _wait_ports(m: Master, timeout: float = 30.0) -> None:
    host, port = m.rpc.split(":")
    http = int(m.metadata.rsplit(":", 1)[1].split("/")[0])
    deadline = time.monotonic() + timeout
    for p in (int(port), http):
        while True:
            if m.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited ({m.process.returncode}); see {m.log}")
            with contextlib.suppress(OSError), socket.create_connection((host, p), timeout=0.5):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake_master did not listen on {host}:{p}; see {m.log}")
            time.sleep(0.05)
    time.sleep(0.3)  # the master reports ready a moment after it listens


@contextlib.contextmanager
def running_master(log_dir: Path) -> Iterator[Master]:
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    log = log_dir / "mooncake_master.log"
    args = [
        master_binary(),
        "-rpc_address=127.0.0.1",
        f"-rpc_port={rpc}",
        "-enable_http_metadata_server=true",
        "-http_metadata_server_host=127.0.0.1",
        f"-http_metadata_server_port={http}",
        f"-metrics_port={metrics}",
        "-default_kv_lease_ttl=100",  # ms: a read holds an object this long against removal
        "-client_ttl=2",  # s: a killed client's segment is dropped after this long
    ]
    m = Master(f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata", _spawn(args, log), args, log)
    try:
        _wait_ports(m)
        yield m
    finally:
        if m.process.poll() is None:
            m.process.terminate()
            try:
                m.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                m.kill()


def engine_process(conn, rank: int, master: str, metadata: str) -> None:
    """An engine host: the demo engine on the CPU with its own host pool over the shared tier.
    Serves (request_id, prompt, new_tokens) from `conn` until None; answers with the generated
    tokens, the tokens served from the cache and from the tier."""
    import torch

    from hicache.demo import PRESETS, PagedEngine, TinyTransformer
    from hicache.mooncake import MooncakeTier

    torch.set_num_threads(1)
    model = TinyTransformer(PRESETS["tiny"], torch.device("cpu"), torch.float32, seed=1)
    tier = MooncakeTier(master, metadata, segment_bytes=128 << 20)
    engine = PagedEngine(model, num_blocks=64, block_tokens=32, cache_pages=200, tier=tier)
    assert engine.cache is not None
    conn.send("ready")
    while (req := conn.recv()) is not None:
        rid, prompt, new = req
        before = engine.cache.stats().tier_hit_tokens
        res = engine.run_request(rid, prompt, new)
        engine.cache.flush_tier()  # its pages reach the tier before the next turn elsewhere
        after = engine.cache.stats()
        conn.send((res.generated, res.cached_tokens, after.tier_hit_tokens - before, after.tier_errors))
    conn.send(engine.cache.stats_dict())
    del engine
    tier.close()
