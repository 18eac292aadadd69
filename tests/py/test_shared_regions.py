"""Shared-memory slot regions from Python: one owner each, and none left behind in /dev/shm.

A region is what vLLM's workers put their host slots in with ``shared_memory: true``. Two
engines once mapped the same region and one served the other's KV; and an engine that was
terminated or killed left its region (with the docs' 64 GiB example, 64 GiB of RAM) until reboot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

from hicache import _core

PAGE = 4096

pytestmark = [
    pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm"),
    pytest.mark.usefixtures("shared_region_lock"),
]


def name() -> str:
    return f"hicache-pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def mover(region: str, create: bool, owner: str = "engine-a", slots: int = 4) -> _core.SlotMover:
    kv = np.zeros((2, PAGE), np.uint8)
    m = _core.SlotMover([kv], slots, "cpu", region, create, slots * PAGE, owner=owner, attach_timeout_s=2.0)
    m.wait([m.submit(True, np.array([0], np.int64), np.array([0], np.int64), 0)])  # maps it
    return m


def test_a_region_belongs_to_one_engine_and_others_are_told_why_not() -> None:
    r = name()
    first = mover(r, create=True)
    assert mover(r, create=False).num_slots == 4  # the same engine's other worker attaches
    with pytest.raises(Exception, match=rf"in use by process {os.getpid()} \(owner 'engine-a'\)"):
        mover(r, create=True, owner="engine-b")  # a second engine that names it
    with pytest.raises(Exception, match="belongs to owner 'engine-a', not 'engine-b'"):
        mover(r, create=False, owner="engine-b")
    with pytest.raises(Exception, match="holds 16384 bytes, not the 20480"):
        mover(r, create=False, slots=5)
    del first
    assert not Path(f"/dev/shm/{r}").exists()


CHILD = textwrap.dedent(
    """
    import signal, sys, time
    import numpy as np
    from hicache import _core
    if sys.argv[2] == "handler":  # the program's own handler, set before the region (as vLLM does)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    kv = np.zeros((2, 4096), np.uint8)
    m = _core.SlotMover([kv], 4, "cpu", sys.argv[1], True, 4 * 4096, owner="child")
    m.wait([m.submit(True, np.array([0], np.int64), np.array([0], np.int64), 0)])
    print("ready", flush=True)
    if sys.argv[2] == "exit":
        import os
        os._exit(0)  # no cleanup of any kind runs
    time.sleep(60)
    """
)


def child(region: str, how: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, region, how], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    assert Path(f"/dev/shm/{region}").exists()
    return p


@pytest.mark.parametrize("how", ["default", "handler"])
def test_sigterm_removes_the_region_and_the_process_still_ends_as_it_would(how: str) -> None:
    r = name()
    p = child(r, how)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=30)
    assert rc == (-signal.SIGTERM if how == "default" else 7)
    assert not Path(f"/dev/shm/{r}").exists()


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_a_killed_engines_region_is_reclaimed_by_the_next_one(how: str) -> None:
    r = name()
    p = child(r, how if how == "exit" else "default")
    if how == "kill":
        p.kill()
    p.wait(timeout=30)
    assert Path(f"/dev/shm/{r}").exists()  # nothing of the process ran: left behind
    with pytest.raises(Exception, match="which is gone"):
        mover(r, create=False, owner="child")  # and nobody may attach to it
    live = name()
    keep = mover(live, create=True)  # the next engine's region, any name: reclaims dead ones
    assert not Path(f"/dev/shm/{r}").exists()
    assert Path(f"/dev/shm/{live}").exists()  # a live engine's stays
    assert live not in _core.reclaim_shared_regions()
    del keep
