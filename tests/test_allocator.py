"""Specification of the allocator tuning a CPU backend runs under: memory a step frees is reused by the next
step's allocations, not mapped afresh (which would fault on every page it touches). Measured in a fresh process of
its own, as a backend is: the test process's heap holds what every other test left in it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pinned_backend.allocator import keep_freed_memory

# Prints the minor page faults of ten steps on a new thread, after twenty to settle the heap, each step allocating
# and touching five tensors of the given MiB that live together (as a layer's gathered keys, values and scores do)
# and freeing them; and the pages of one step's tensors.
PROBE = """
import resource, sys, threading, torch
from pinned_backend.allocator import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
size = int(sys.argv[2]) << 20


def step():
    live = [torch.empty(size, dtype=torch.uint8) for _ in range(5)]
    for tensor in live:
        tensor.fill_(1)


def steps():
    for _ in range(20):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, 5 * size // resource.getpagesize())


# On a thread started after the tuning, as the engine's is.
thread = threading.Thread(target=steps)
thread.start()
thread.join()
"""


def page_faults(mode: str, mib: int) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(mib)], capture_output=True, text=True, timeout=120, check=True
    )
    faults, pages = done.stdout.split()
    return int(faults), int(pages)


@pytest.mark.parametrize("mib", [8, 96])  # 96: larger than one of glibc's per-thread heaps
def test_freed_step_memory_is_reused_without_faulting_its_pages_in_again(mib: int) -> None:
    if not keep_freed_memory():
        pytest.skip("the C library is not glibc, or refused a setting: its allocator is left as it is")
    untuned, pages = page_faults("plain", mib)
    tuned, _ = page_faults("tuned", mib)
    # glibc's own way hands a freed step back to the kernel and faults it in again (here three steps of ten); tuned,
    # every step reuses the heap.
    assert untuned > pages, f"{untuned} faults untuned: this glibc keeps freed memory by itself"
    assert tuned < pages // 10, f"{tuned} faults tuned, {untuned} untuned"


def test_tuning_twice_is_harmless() -> None:
    assert keep_freed_memory() == keep_freed_memory()
