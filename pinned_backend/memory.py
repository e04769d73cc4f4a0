"""How much memory this process may still fill: what sizes the KV cache when its size is not given.

On a GPU, the device's free memory as CUDA reports it. On the CPU, the host's `MemAvailable` (/proc/meminfo), or
less where the process's control group allows less: a container's limit, not the host's memory, is what an
allocation past it runs into. Reading the machine is `available_bytes`'s alone; the arithmetic is pure. What
share of it the cache takes is the KV cache's business (kvcache.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# (limit, usage) files of the control group the process runs in: cgroup v2, then v1.
_CGROUP_FILES = (
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (
        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
        Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ),
)
_NO_LIMIT = 2**60  # cgroup v1 says "unlimited" with a number near 2**63


def host_available(meminfo: str, *, limit: str | None, usage: str | None) -> int:
    """Bytes available: `MemAvailable` from /proc/meminfo's text, bounded by a control group's `limit` less its
    `usage` (the files' texts, None when there are none; `max` is no limit)."""
    available = 0
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "MemAvailable":
            available = int(value.split()[0]) * 1024  # in kB
    if limit is None or usage is None or limit.strip() == "max" or int(limit) >= _NO_LIMIT:
        return available
    return max(0, min(available, int(limit) - int(usage)))


def available_bytes(device: torch.device) -> int:
    """The memory this process may still fill on `device`."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        # Not Linux: what the OS reports as free physical memory.
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit, usage in _CGROUP_FILES:
        if limit.is_file() and usage.is_file():
            return host_available(meminfo, limit=limit.read_text(), usage=usage.read_text())
    return host_available(meminfo, limit=None, usage=None)
