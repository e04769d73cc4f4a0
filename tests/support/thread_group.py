"""Ranks of a tensor-parallel group as threads of one process, on one device: what lets one GPU run the shards of
degree 2 and 4 side by side and compare their bits with one process's. Every rank calls the same collectives in
the same order, as over gloo or NCCL; a collective is a barrier around a shared list."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")
_WAIT_S = 300.0  # a rank that failed leaves the others waiting at most this long


class ThreadGroup:
    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=_WAIT_S)
        self._slots: list[torch.Tensor | None] = [None] * size

    def member(self, rank: int) -> ThreadRank:
        return ThreadRank(self, rank)

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = tensor
        self._barrier.wait()
        out = [t for t in self._slots if t is not None]
        self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return out


class ThreadRank:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._group = group
        self.rank = rank
        self.size = group.size

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone() for t in self._group.exchange(self.rank, tensor)]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._group.exchange(self.rank, tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def broadcast(self, tensor: torch.Tensor, *, idle: bool = False) -> torch.Tensor:
        return self._group.exchange(self.rank, tensor)[0].clone()


def run_ranks(work: Sequence[Callable[[], T]]) -> list[T]:
    """Run each rank's `work` on a thread of its own; their results in rank order (the first error re-raised)."""
    results: list[T | None] = [None] * len(work)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work[rank]()
        except BaseException as e:  # re-raised on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]
