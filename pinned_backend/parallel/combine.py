"""Where a tensor-parallel forward pass meets the other ranks: the row-parallel sums, the embedding lookup and the
LM head's logits.

`batch_invariant` sums a row-parallel product as a fixed tree: every chunk's partial product (shards.py fixes the
chunks by the model alone) is gathered from the rank that holds it, and the partials are added in chunk order, in
float32, then rounded once to the model's dtype. One process computes every chunk itself and adds them in that
same order, so the bits are those of every degree. `default` sums each rank's whole share with the library's
all-reduce, as engines do, and so its answers may change with the degree.

The embedding and the LM head need no sum: a token's embedding row lives on one rank and is gathered from it (a
copy, exact), and each rank computes its own vocabulary's logits whole (gathered, then laid side by side).
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Literal, Protocol

import torch

from pinned_backend.kernels import Kernels
from pinned_backend.parallel.shards import Shard

Reduction = Literal["tree", "all_reduce"]
_IDLE_WAIT = timedelta(days=3650)


class Group(Protocol):
    """The ranks' communicator: every rank calls the same collectives in the same order."""

    rank: int
    size: int

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (all of one shape and dtype), in rank order."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `tensor`, in whatever order the library picks."""
        ...

    def broadcast(self, tensor: torch.Tensor, *, idle: bool = False) -> torch.Tensor:
        """Rank 0's `tensor`, on every rank (filled in place); `idle`: waited for without a timeout."""
        ...


class Solo:
    """The group of one process: nothing to send."""

    rank = 0
    size = 1

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, *, idle: bool = False) -> torch.Tensor:
        return tensor


class ProcessGroupComm:
    """A torch.distributed process group of its own (gloo on the CPU, NCCL on GPUs), not the global default group,
    so that several can live in one process."""

    def __init__(self, group: torch.distributed.ProcessGroup, rank: int, size: int) -> None:
        self._group = group
        self.rank = rank
        self.size = size

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._group.allgather([out], [tensor]).wait()
        return out

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        self._group.allreduce([tensor]).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, *, idle: bool = False) -> torch.Tensor:
        """`idle`: the wait of a rank for rank 0's next step, which may come after any time the server idles; the
        group's timeout bounds every other collective."""
        self._group.broadcast(tensor, 0, _IDLE_WAIT if idle else None).wait()
        return tensor

    def close(self) -> None:
        """Release the group's communicators (NCCL's, whose monitor thread would otherwise outlive the store)."""
        shutdown = getattr(self._group, "shutdown", None)
        if shutdown is not None:
            shutdown()


class Parallel:
    """One rank's view of the group while it computes its shard."""

    def __init__(self, shard: Shard, group: Group, reduction: Reduction, hidden_size: int) -> None:
        if group.size != shard.degree or group.rank != shard.rank:
            raise ValueError(
                f"the shard is rank {shard.rank} of {shard.degree}; the group is {group.rank} of {group.size}"
            )
        self.shard = shard
        self.group = group
        self.reduction = reduction
        o_counts, down_counts = shard.chunk_counts()
        self._counts = {"o": o_counts, "down": down_counts}
        self._widths = {"o": shard.o_widths(), "down": shard.down_widths()}
        self._vocab_starts = torch.tensor(shard.vocab_edges[1:-1], dtype=torch.int64)
        # A dropped slot (expert -1) holds zeros everywhere: any rank's copy will do, the last's here.
        owners = [shard.expert_owner(e) for e in range(shard.experts_total)]
        self._expert_owners = torch.tensor([*owners, shard.degree - 1], dtype=torch.int64)
        self.hidden_size = hidden_size

    def split_weight(self, which: Literal["o", "down"], w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A row-parallel weight [N, K_local] as `row` takes it: cut into this rank's chunks under the tree, whole
        under the all-reduce."""
        if self.reduction == "all_reduce":
            return (w,)
        return tuple(part.contiguous() for part in w.split(self._widths[which], dim=1))

    def row(
        self, kernels: Kernels, which: Literal["o", "down"], x: torch.Tensor, parts: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """x [T, K_local] @ the row-parallel weight (`parts`, from `split_weight`) -> [T, N], summed over every
        rank."""
        width = self.hidden_size
        if self.reduction == "all_reduce":
            local = kernels.matmul(x, parts[0]) if x.shape[1] else x.new_zeros(x.shape[0], width)
            return self.group.all_reduce(local) if self.group.size > 1 else local
        pieces = x.split(self._widths[which], dim=1)
        partials = [kernels.matmul(piece, weight) for piece, weight in zip(pieces, parts, strict=True)]
        counts = self._counts[which]
        if self.group.size > 1:
            padded = x.new_zeros(max(counts), x.shape[0], width)
            for j, partial in enumerate(partials):
                padded[j] = partial
            gathered = self.group.all_gather(padded)
            partials = [part for rank, block in enumerate(gathered) for part in block[: counts[rank]]]
        total = partials[0].float()
        for partial in partials[1:]:
            total = total + partial.float()
        return total.to(x.dtype)

    @property
    def experts(self) -> range:
        """The routed experts this rank holds (expert parallelism)."""
        return self.shard.experts

    def gather_slots(self, slots: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each expert slot [T * k, hidden] as the rank holding its expert (`experts` [T * k], -1 dropped)
        computed it: a copy, so a token's sum over its slots is one process's."""
        if self.group.size == 1:
            return slots
        gathered = torch.stack(self.group.all_gather(slots))
        owner = self._expert_owners.to(experts.device)[experts]
        return gathered[owner, torch.arange(slots.shape[0], device=slots.device)]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(tensor) if self.group.size > 1 else tensor

    def embed(self, table: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows [T, hidden] of `token_ids`, each copied from the rank whose vocabulary holds it."""
        if self.group.size == 1:
            return table[token_ids]
        vocab = self.shard.vocab
        local = (token_ids >= vocab.start) & (token_ids < vocab.stop)
        rows = table.new_zeros(token_ids.shape[0], table.shape[1])
        rows[local] = table[token_ids[local] - vocab.start]
        gathered = torch.stack(self.group.all_gather(rows))
        owner = torch.bucketize(token_ids, self._vocab_starts.to(token_ids.device), right=True)
        return gathered[owner, torch.arange(token_ids.shape[0], device=token_ids.device)]

    def logits(self, kernels: Kernels, h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """h [R, hidden] -> [R, vocab] in the model's dtype, each rank's vocabulary computed there."""
        local = kernels.matmul(h, lm_head)
        if self.group.size == 1:
            return local
        edges = self.shard.vocab_edges
        widest = max(b - a for a, b in itertools.pairwise(edges))
        padded = local.new_zeros(h.shape[0], widest)
        padded[:, : local.shape[1]] = local
        gathered = self.group.all_gather(padded)
        return torch.cat(
            [block[:, : b - a] for block, a, b in zip(gathered, edges, edges[1:], strict=False)], 1
        )
