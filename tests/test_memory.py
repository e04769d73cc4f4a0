"""How much memory the backend finds for its KV cache: the host's available memory, within its control group's
limit, or a GPU's free memory."""

from __future__ import annotations

import torch

from pinned_backend.memory import available_bytes, host_available

MEMINFO = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


def test_the_hosts_available_memory_is_memavailable() -> None:
    assert host_available(MEMINFO, limit=None, usage=None) == 20000000 * 1024


def test_a_control_groups_limit_bounds_it() -> None:
    assert host_available(MEMINFO, limit="4294967296\n", usage="1073741824\n") == 3 * 2**30
    assert host_available(MEMINFO, limit="max\n", usage="1073741824\n") == 20000000 * 1024, (
        "cgroup v2: no limit"
    )
    # cgroup v1 says "no limit" with a huge number.
    assert host_available(MEMINFO, limit="9223372036854771712", usage="7008178176") == 20000000 * 1024
    assert host_available(MEMINFO, limit="1000", usage="2000") == 0, "over its limit: nothing to spare"


def test_this_machine_has_some() -> None:
    assert available_bytes(torch.device("cpu")) > 0
