"""The fused kernel families unfused: spelled as the plain PyTorch ops they fuse, for the kernel sets that do not
fuse them (the CPU's).

`UnfusedKernels` gives a kernel set `add_rms_norm`, `silu_mul` and `qkv_rope_cache` (shapes in
`pinned_backend.kernels`) built from elementwise torch ops and the set's own `rms_norm`, so that the CPU's
invariant norm stays the norm wherever these families normalise. The ops and their roundings are the model's as it
was written before these families existed; the CPU backend's tests hold them to that bit for bit. This module
knows nothing of the model object, only of tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in float32, rounded once to x's dtype.

    Spelled with exp, add and divide on purpose: on the CPU, PyTorch's fused float32 silu (and sigmoid) gives an
    element other bits when it falls in the scalar tail of a vectorised loop, which depends on the tensor's
    length; exp, add and divide give each element the same bits wherever it sits (tests/test_model.py).
    """
    x32 = x.float()
    return (x32 / (1 + torch.exp(-x32))).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [..., H, D]; cos, sin [..., 1, D/2] float32. Halves rotated as Hugging Face's rotate_half does.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class UnfusedKernels(ABC):
    """The fused families as torch ops over the subclass's own `rms_norm`."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + delta
        return summed, self.rms_norm(summed, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return silu(gate) * up

    def qkv_rope_cache(
        self,
        qkv: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        n_tokens = qkv.shape[0]
        n_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        kv_size = n_kv_heads * head_dim
        q, k, v = qkv.split([qkv.shape[1] - 2 * kv_size, kv_size, kv_size], dim=-1)
        q = q.reshape(n_tokens, -1, head_dim)
        k = k.reshape(n_tokens, n_kv_heads, head_dim)
        v = v.reshape(n_tokens, n_kv_heads, head_dim)
        if q_norm is not None:
            q = self.rms_norm(q.reshape(-1, head_dim), q_norm, eps).reshape(q.shape)
        if k_norm is not None:
            k = self.rms_norm(k.reshape(-1, head_dim), k_norm, eps).reshape(k.shape)
        cos, sin = rope_cos[positions][:, None, :], rope_sin[positions][:, None, :]  # [T, 1, D/2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache.view(-1, n_kv_heads, head_dim)[slots] = k.to(k_cache.dtype)
        v_cache.view(-1, n_kv_heads, head_dim)[slots] = v.to(v_cache.dtype)
        return q
