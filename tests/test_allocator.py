"""Specification of the allocator tuning a CPU backend runs under: memory a step frees is reused by the next
step's allocations, not mapped afresh (which would fault on every page it touches)."""

from __future__ import annotations

import resource

import pytest
import torch

from pinned_backend.allocator import keep_freed_memory

BYTES = 16 << 20


def page_faults_of_reallocating(times: int) -> int:
    for _ in range(3):  # the heap grows until a tensor of this size fits in what is free
        torch.empty(BYTES, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        torch.empty(BYTES, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_step_memory_is_reused_without_faulting_its_pages_in_again() -> None:
    if not keep_freed_memory():
        pytest.skip("the C library is not glibc: its allocator is left as it is")
    pages = BYTES // resource.getpagesize()
    # Mapped afresh, each of the ten 16 MiB tensors would fault in its 4096 pages; reused, most fault in none (the
    # heap may still move a tensor or two while the other tests' memory is freed around it).
    assert page_faults_of_reallocating(10) < 3 * pages


def test_tuning_twice_is_harmless() -> None:
    assert keep_freed_memory() == keep_freed_memory()
