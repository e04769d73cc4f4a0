"""Rank r > 0 of a tensor-parallel group: `python -m pinned_backend.parallel.worker STORE RANK DEGREE`, with the
backend's settings as JSON on standard input (rank 0 starts it; group.py).

It loads the checkpoint, keeps its shard, builds the same kernels and a KV cache for its heads with as many blocks
as rank 0's, and computes every step rank 0 broadcasts until told to stop. An error is printed and the process
exits 1, which rank 0 notices at its next collective.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from pinned_backend.kvcache import PagedKVCache
from pinned_backend.loading import load_checkpoint
from pinned_backend.parallel.group import connect, device_of
from pinned_backend.parallel.steps import kv_blocks, serve_steps, shard_model
from pinned_backend.runtime import BackendSettings, kernels_for


def run(settings: BackendSettings, store: Path, rank: int, degree: int) -> None:
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)  # before the kernels record the count, as rank 0 does
    device = device_of(torch.device(settings.device), rank)
    group = connect(store, rank, degree, device)
    dtype = settings.torch_dtype
    checkpoint = load_checkpoint(settings.model, dtype, lambda _: None)
    kernels, _ = kernels_for(settings, checkpoint.config, device)
    model = shard_model(checkpoint.config, checkpoint.weights, kernels, device, dtype, group)
    cache = PagedKVCache(model.config, kv_blocks(group, device), settings.block_size, device, dtype)
    try:
        serve_steps(model, cache, group)
    finally:
        group.close()


def main(argv: list[str] | None = None) -> int:
    store, rank, degree = argv if argv is not None else sys.argv[1:]
    settings = BackendSettings.model_validate_json(sys.stdin.read())
    try:
        run(settings, Path(store), int(rank), int(degree))
    except Exception as e:  # rank 0 reports the exit; this says why
        print(f"stackpin-backend tensor-parallel rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
