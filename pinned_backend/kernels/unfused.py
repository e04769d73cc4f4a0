"""The fused kernel families unfused: spelled as the plain PyTorch ops they fuse, for the kernel sets that do not
fuse them (the CPU's).

`UnfusedKernels` gives a kernel set `add_rms_norm`, `silu_mul`, `gelu_mul` and `qkv_rope_cache` (shapes in
`pinned_backend.kernels`) built from elementwise torch ops and the set's own `rms_norm`, so that the CPU's
invariant norm stays the norm wherever these families normalise; and `head_matmul` and `latent_attention` built
from the set's own `matmul` and `attention`, so that they reduce as those do. The ops and their roundings are the model's as it
was written before these families existed; the CPU backend's tests hold them to that bit for bit. This module
knows nothing of the model object, only of tensors.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from pinned_backend.kernels.cpu_compiled import NOT_COMPILED, CompiledKernels
from pinned_backend.kernels.step_memo import StepMemo


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in float32, rounded once to x's dtype.

    Spelled with exp, add and divide on purpose: on the CPU, PyTorch's fused float32 silu (and sigmoid) gives an
    element other bits when it falls in the scalar tail of a vectorised loop, which depends on the tensor's
    length; exp, add and divide give each element the same bits wherever it sits (tests/test_model.py).
    """
    x32 = x.float()
    return (x32 / (1 + torch.exp(-x32))).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in float32: exp, add and divide, for the reason `silu` gives (PyTorch's float32 sigmoid gives
    an element other bits in a vectorised loop's tail)."""
    return 1 / (1 + torch.exp(-x.float()))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (Gemma's `gelu_pytorch_tanh`) in float32, rounded once to x's dtype; spelled out,
    since PyTorch's fused float32 GELU gives an element other bits by where it sits (tests/test_model.py)."""
    x32 = x.float()
    inner = math.sqrt(2 / math.pi) * (x32 + 0.044715 * x32 * x32 * x32)
    return (0.5 * x32 * (1 + torch.tanh(inner))).to(x.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), elementwise in x's dtype (Gemma 2's soft-capping of scores and logits)."""
    return torch.tanh(x / cap) * cap


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: gate_up [T, 2I] (gate columns first) -> [T, I] =
    (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit); in float32, rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    glu = gate / (1 + torch.exp(-alpha * gate))
    return ((up.clamp(-limit, limit) + 1) * glu).to(gate_up.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [..., H, D]; cos, sin [..., 1, D/2] float32. Halves rotated as Hugging Face's rotate_half does.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class UnfusedKernels(ABC):
    """The fused families as torch ops over the subclass's own `rms_norm`."""

    def __init__(self, compiled: CompiledKernels = NOT_COMPILED) -> None:
        """`compiled`: the set's compiled kernels, where it has them: the residual add and the rotation with the
        cache write then run compiled, with the torch ops' bits (tests/test_kernels_unfused.py)."""
        self._rope_memo = StepMemo()
        self.compiled = compiled

    @property
    def cpu_kernels(self) -> str:
        """How the stack names the set's attention and per-row ops: "compiled" or "torch"."""
        return self.compiled.name

    @property
    def kernels_unbuilt(self) -> str:
        """Why the compiled kernels do not serve; "" where they do."""
        return self.compiled.unbuilt

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    @abstractmethod
    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

    def plan_like(self, shard: tuple[int, int], whole: tuple[int, int]) -> None:  # noqa: B027 (nothing to do)
        """The CPU's matmuls have no plans: a column's sum is the BLAS's whatever the columns around it."""

    @abstractmethod
    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        scale: float,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x [T, H, K], w [H, N, K] -> [T, H, N]: each head through the set's own matmul.
        return torch.stack([self.matmul(x[:, head], w[head]) for head in range(w.shape[0])], dim=1)

    def latent_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        scale: float,
        v_dim: int,
    ) -> torch.Tensor:
        # The cache is both keys and values; a value is a key's first v_dim elements.
        return self.attention(q, cache, cache, block_tables, query_seq, query_pos, scale)[..., :v_dim]

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.compiled.layer_ops
        if ops is not None and ops.serves(x, delta, weight):
            return ops.add_rms_norm(x, delta, weight, eps)  # the subclass's rms_norm is the same op
        summed = x + delta
        return summed, self.rms_norm(summed, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return silu(gate) * up

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return gelu_tanh(gate) * up

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
        ops = self.compiled.layer_ops
        if (
            ops is not None
            and q_norm is None
            and k_norm is None
            and ops.serves(qkv, k_cache, v_cache)
            and rope_cos.dtype == rope_sin.dtype == torch.float32
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        ):
            return ops.rope_cache(qkv, rope_cos, rope_sin, positions, slots, k_cache, v_cache)
        n_tokens = qkv.shape[0]
        n_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        kv_size = n_kv_heads * head_dim
        q_size = qkv.shape[1] - 2 * kv_size
        cos, sin = self._rope_rows(rope_cos, rope_sin, positions)  # [T, 1, D/2]
        if q_norm is None and k_norm is None:
            # q's heads and k's side by side, rotated in one pass: the rotation is elementwise, so every element gets
            # the bits it gets rotated apart
            qk = apply_rope(qkv[:, : q_size + kv_size].reshape(n_tokens, -1, head_dim), cos, sin)
            q, k = qk[:, : q_size // head_dim], qk[:, q_size // head_dim :]
        else:
            q = qkv[:, :q_size].reshape(n_tokens, -1, head_dim)
            k = qkv[:, q_size : q_size + kv_size].reshape(n_tokens, n_kv_heads, head_dim)
            if q_norm is not None:
                q = self.rms_norm(q.reshape(-1, head_dim), q_norm, eps).reshape(q.shape)
            if k_norm is not None:
                k = self.rms_norm(k.reshape(-1, head_dim), k_norm, eps).reshape(k.shape)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = qkv[:, q_size + kv_size :].reshape(n_tokens, n_kv_heads, head_dim)
        # index_copy_ writes whole rows; assigning through an index tensor would address every element.
        k_cache.view(-1, n_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, n_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
        return q

    def _rope_rows(
        self, rope_cos: torch.Tensor, rope_sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary rows [T, 1, D/2] of the step's positions, read once a step (kernels.step_memo). The value
        holds the tables, so that their identities, the key, stay theirs while it is kept."""
        tables, cos, sin = self._rope_memo.get(
            (positions,),
            (id(rope_cos), id(rope_sin)),
            lambda: ((rope_cos, rope_sin), rope_cos[positions][:, None, :], rope_sin[positions][:, None, :]),
        )
        assert tables[0] is rope_cos and tables[1] is rope_sin
        return cos, sin
