"""A tensor-parallel model as the engine sees it, and the loop the other ranks run.

The scheduler runs on rank 0 alone: it decides each step (which tokens, their positions, the block tables, the
rows whose logits it needs) and broadcasts it before computing its own shard, so the ranks never disagree on a
batch. Every rank writes its own heads' keys and values into its own KV cache at the same slots, so the block
tables, the prefix cache's sharing and speculation's rejected drafts need nothing more from the others. Rank 0
returns the logits; the others' copies are dropped.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from pinned_backend.kernels import Kernels
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.model import Transformer, matmul_shapes
from pinned_backend.model_config import ModelConfig
from pinned_backend.parallel.combine import Group, Parallel, ProcessGroupComm
from pinned_backend.parallel.group import Workers, device_of, join, start_workers
from pinned_backend.parallel.shards import plan_shard, shard_config, shard_weights

_FORWARD, _HIDDEN, _STOP = 1, 2, 3
# The weights a rank holds a column slice of (model.matmul_shapes' names): each takes its whole weight's plan.
COLUMN_PARALLEL = ("qkv", "gate_up", "lm_head")
_HEADER = 5  # op, tokens, sequences, table width, rows


def shard_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    kernels: Kernels,
    device: torch.device,
    dtype: torch.dtype,
    group: Group,
) -> Transformer:
    """This rank's Transformer: its shard of `weights` (consumed), summing row-parallel products as the kernel
    mode promises (a fixed tree under `batch_invariant`, the library's all-reduce under `default`)."""
    shard = plan_shard(config, group.size, group.rank)
    reduction = "tree" if kernels.mode == "batch_invariant" else "all_reduce"
    parallel = Parallel(shard, group, reduction, config.hidden_size)
    local_config = shard_config(config, shard)
    whole, cut = matmul_shapes(config), matmul_shapes(local_config)
    for name in COLUMN_PARALLEL:
        if name in whole and cut[name] != whole[name] and cut[name][0] > 0:
            kernels.plan_like(cut[name], whole[name])
    local = shard_weights(config, weights, shard)
    return Transformer(local_config, local, kernels, device, dtype, parallel=parallel)


def start_parallel(
    settings_json: str,
    degree: int,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    kernels: Kernels,
    device: torch.device,
    dtype: torch.dtype,
) -> ParallelModel:
    """Start ranks 1..degree-1 with the backend's settings, join them as rank 0 and cut rank 0's shard of
    `weights` (consumed). The caller sizes the KV cache, builds rank 0's and calls `start`."""
    workers, store = start_workers(settings_json, degree)
    try:
        group = join(store, workers, device_of(device, 0))
        local = shard_model(config, weights, kernels, device, dtype, group)
    except BaseException:
        workers.kill()
        raise
    return ParallelModel(local, config, group, workers)


class RankGone(RuntimeError):
    """A rank of the group has exited; the group cannot compute any more steps."""


class ParallelModel:
    """Rank 0's model: each call is broadcast to every rank, then computed on rank 0's shard."""

    def __init__(self, local: Transformer, config: ModelConfig, group: Group, workers: Workers) -> None:
        self.local = local
        self.config = config  # the whole model's; `local.config` is rank 0's shard, which its KV cache holds
        self.group = group
        self.workers = workers
        self._lock = threading.Lock()  # one step at a time reaches the group, whoever calls

    def start(self, num_blocks: int) -> None:
        """Tell the other ranks how many KV blocks to keep; every rank's cache has the same blocks."""
        self._collective(lambda: self.group.broadcast(torch.tensor([num_blocks], device=self._device)))

    def forward(
        self,
        token_ids: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        block_tables: torch.Tensor,
        cache: PagedKVCache,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        step = (token_ids, query_seq, query_pos, block_tables, cache, logits_rows)
        return self._step(_FORWARD, self.local.forward, step)

    def hidden_states(
        self,
        token_ids: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        block_tables: torch.Tensor,
        cache: PagedKVCache,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        return self._step(
            _HIDDEN, self.local.hidden_states, (token_ids, query_seq, query_pos, block_tables, cache, rows)
        )

    def _step(self, op: int, compute: Callable[..., torch.Tensor], step: tuple[Any, ...]) -> torch.Tensor:
        """Broadcast the step, then compute rank 0's shard of it."""
        token_ids, query_seq, query_pos, block_tables, _cache, rows = step
        with self._lock:
            self._send(op, token_ids, query_seq, query_pos, block_tables, rows)
            return self._collective(lambda: compute(*step))  # type: ignore[no-any-return]

    def close(self) -> None:
        """Tell the other ranks to leave, and wait for them."""
        with self._lock:
            if not self.workers.stopped and not self.workers.gone():
                # A rank gone meanwhile fails the broadcast; stop() ends the rest.
                with contextlib.suppress(RuntimeError):
                    self.group.broadcast(torch.tensor([_STOP, 0, 0, 0, 0], device=self._device))
            if isinstance(self.group, ProcessGroupComm):
                self.group.close()
            self.workers.stop()

    @property
    def _device(self) -> torch.device:
        return self.local.device

    def _send(self, op: int, *tensors: torch.Tensor) -> None:
        if self.group.size == 1:
            return
        token_ids, _seq, _pos, tables, rows = tensors
        header = [op, token_ids.shape[0], tables.shape[0], tables.shape[1], rows.shape[0]]
        payload = torch.cat([t.reshape(-1).to(device=self._device, dtype=torch.int64) for t in tensors])
        self._collective(lambda: self.group.broadcast(torch.tensor(header, device=self._device)))
        self._collective(lambda: self.group.broadcast(payload))

    def _collective(self, work: Any) -> Any:
        try:
            return work()
        except RuntimeError as e:
            gone = self.workers.gone()
            if not gone:
                raise
            codes = ", ".join(f"rank {r} (exit {self.workers.processes[r - 1].returncode})" for r in gone)
            raise RankGone(f"tensor-parallel {codes} exited; restart the backend") from e


def serve_steps(model: Transformer, cache: PagedKVCache, group: Group) -> None:
    """The loop of ranks 1..N-1: compute each step rank 0 broadcasts, until it says stop."""
    device = model.device
    while True:
        header = group.broadcast(torch.zeros(_HEADER, dtype=torch.int64, device=device), idle=True)
        op, tokens, sequences, width, rows = header.tolist()
        if op == _STOP:
            return
        payload = group.broadcast(
            torch.empty(3 * tokens + sequences * width + rows, dtype=torch.int64, device=device)
        )
        token_ids, query_seq, query_pos, tables, wanted = payload.split(
            [tokens, tokens, tokens, sequences * width, rows]
        )
        step = (
            token_ids,
            query_seq.to(torch.int32),
            query_pos.to(torch.int32),
            tables.reshape(sequences, width).to(torch.int32),
            cache,
            wanted,
        )
        if op == _FORWARD:
            model.forward(*step)
        else:
            model.hidden_states(*step)


def kv_blocks(group: Group, device: torch.device) -> int:
    """On ranks 1..N-1: the KV cache's block count, as rank 0's `ParallelModel.start` sends it."""
    return int(group.broadcast(torch.zeros(1, dtype=torch.int64, device=device)).item())
