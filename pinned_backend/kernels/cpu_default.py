"""The `default` kernel mode on the CPU: plain PyTorch ops, as fast as the library makes them, not batch invariant.

This is what an ordinary server runs (on CUDA, `default` is cuBLAS over the Triton kernels: `kernels.triton`).
The reduction order of each op is whatever PyTorch picks for the shapes of the step, so a row's result may change
with the batch around it; the `batch_invariant` modes exist to fix that. The fused families are the torch ops they
fuse (`kernels.unfused`). It knows nothing of the model beyond the shapes in `pinned_backend.kernels`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pinned_backend.kernels import KernelMode
from pinned_backend.kernels.unfused import UnfusedKernels


class TorchKernels(UnfusedKernels):
    mode: KernelMode = "default"

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.float(), dim=-1)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        # One scaled_dot_product_attention call per sequence over its gathered cache. The loop reads the
        # positions to the host; the default mode accepts that cost for simplicity.
        block_size, n_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        out = torch.empty_like(q)
        for seq in torch.unique(query_seq).tolist():
            rows = torch.nonzero(query_seq == seq).squeeze(1)
            pos = query_pos[rows].long()
            length = int(pos.max()) + 1
            n_blocks = -(-length // block_size)
            blocks = block_tables[seq, :n_blocks].long()
            keys = k_cache[blocks].reshape(-1, n_kv_heads, head_dim)[:length]  # [L, Hkv, D]
            values = v_cache[blocks].reshape(-1, n_kv_heads, head_dim)[:length]
            mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]  # [Tq, L]
            attended = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),  # [Hq, Tq, D]
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            out[rows] = attended.transpose(0, 1)
        return out
