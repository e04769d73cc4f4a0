"""A small paged-attention decoder with the forward signature of pinned_backend.model.Transformer, for tests.

It exercises the engine's scheduling (chunked prefill, paged blocks, joining and leaving) independently of
the real checkpoint loader, and lets a test choose kernels. Its outputs mean nothing; only their determinism
does."""

from __future__ import annotations

import torch

from pinned_backend.kernels import reference
from pinned_backend.kernels.torch_ops import TorchKernels


class InvariantStandinKernels(TorchKernels):
    """Float64 accumulation row by row: invariant by construction, slow, enough for a stand-in."""

    mode = "batch_invariant"  # type: ignore[assignment]

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return reference.matmul(x, w).to(x.dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return reference.rms_norm(x, weight, eps).to(x.dtype)

    def attention(self, q, k_cache, v_cache, block_tables, query_seq, query_pos, scale):  # type: ignore[no-untyped-def]
        return reference.attention(q, k_cache, v_cache, block_tables, query_seq, query_pos, scale).to(q.dtype)


class StandinCache:
    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> None:
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.block_size = block_size


class StandinAllocator:
    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError("cache full")
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class StandinModel:
    def __init__(self, kernels: TorchKernels, vocab: int = 48, dim: int = 32, layers: int = 2, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.kernels, self.vocab, self.heads, self.kv_heads, self.head_dim = kernels, vocab, 2, 1, 16
        self.layers = layers
        self.embed = torch.randn(vocab, dim, generator=g)
        self.w = [
            {
                name: torch.randn(shape, generator=g) / shape[1] ** 0.5
                for name, shape in {
                    "q": (32, dim),
                    "k": (16, dim),
                    "v": (16, dim),
                    "o": (dim, 32),
                    "up": (64, dim),
                    "down": (dim, 64),
                }.items()
            }
            for _ in range(layers)
        ]
        self.lm_head = torch.randn(vocab, dim, generator=g) * 2

    def new_cache(self, num_blocks: int, block_size: int) -> StandinCache:
        return StandinCache(self.layers, num_blocks, block_size, self.kv_heads, self.head_dim)

    def forward(self, token_ids, query_seq, query_pos, block_tables, cache, logits_rows):  # type: ignore[no-untyped-def]
        kn = self.kernels
        x = self.embed[token_ids]
        blocks = block_tables[query_seq.long(), (query_pos // cache.block_size).long()].long()
        slots = (query_pos % cache.block_size).long()
        for layer, w in enumerate(self.w):
            h = kn.rms_norm(x, torch.ones(x.shape[1]), 1e-6)
            q = kn.matmul(h, w["q"]).view(-1, self.heads, self.head_dim)
            cache.k[layer, blocks, slots] = kn.matmul(h, w["k"]).view(-1, self.kv_heads, self.head_dim)
            cache.v[layer, blocks, slots] = kn.matmul(h, w["v"]).view(-1, self.kv_heads, self.head_dim)
            att = kn.attention(q, cache.k[layer], cache.v[layer], block_tables, query_seq, query_pos, 0.25)
            x = x + kn.matmul(att.reshape(len(x), -1), w["o"])
            h = kn.rms_norm(x, torch.ones(x.shape[1]), 1e-6)
            x = x + kn.matmul(torch.nn.functional.silu(kn.matmul(h, w["up"])), w["down"])
        return kn.matmul(x[logits_rows], self.lm_head).float()


def detokenize(ids: list[int]) -> str:
    """Each token id is one lowercase letter or a space, so stop strings have something to find."""
    alphabet = "abcdefghijklmnopqrstuvwxyz "
    return "".join(alphabet[i % len(alphabet)] for i in ids)
