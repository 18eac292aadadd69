"""The machine's memory as the core reads it, against Python's own reading of /proc/meminfo.

Pools pinned in the background pace themselves by it (they pause while too little is left). On
an H200 host, inside a Python process, the core's old iostream parser read MemTotal and
MemAvailable as 0, so every sweep waited for good and pools never grew past their first chunk;
the GPU run of this file is what catches that where CPU runs cannot.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import hicache
from hicache import _core


def meminfo() -> tuple[int, int]:
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            fields[key] = int(rest.split()[0]) << 10
    return fields["MemTotal"], fields["MemAvailable"]


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="no /proc/meminfo (not Linux)")
def test_the_core_reads_the_machines_memory_as_python_does() -> None:
    before = meminfo()
    got = _core.host_memory()
    after = meminfo()
    assert got is not None
    total, available = got
    assert total == before[0] == after[0]
    slack = 1 << 30  # other processes allocate and free meanwhile
    assert min(before[1], after[1]) - slack <= available <= max(before[1], after[1]) + slack


def test_a_cpu_pool_grows_on_demand_and_says_so() -> None:
    cache = hicache.HostPrefixCache(np.zeros((8, 1024), np.uint8), block_tokens=4, capacity_pages=8)
    s = cache.stats()
    assert (s.pinning, s.pinning_note, s.host_bytes, s.host_bytes_capacity) == ("on demand", "", 0, 8 * 1024)
    cache.store("a", list(range(33)), list(range(8)))
    s = cache.stats()
    assert (s.pinning, s.host_bytes) == ("whole", 8 * 1024)  # one chunk holds the whole pool
