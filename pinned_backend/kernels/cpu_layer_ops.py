"""A layer's per-row work on the CPU as compiled calls (`cpu_layer_ops.c`): RMSNorm, the residual add fused with
it, and the rotary embedding with the KV cache write. Each replaces several torch ops (and their dispatch, which at a
decode step of one sequence cost more than their arithmetic) with one call.

The norm reduces each row alone in an order fixed by its width; the add and the rotation give the torch ops' own bits
(tests/test_kernels_unfused.py holds the kernel sets to that). Float32 and bfloat16 only: `serves` says whether a
call can take its tensors, and the kernel sets run the torch ops otherwise.
"""

from __future__ import annotations

import ctypes

import torch

from pinned_backend.kernels import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_SOURCE = native.SOURCES / "cpu_layer_ops.c"

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class CompiledLayerOps:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._rms_norm = library.stackpin_rms_norm
        self._rms_norm.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float, _int, _int]
        self._rms_norm.restype = None
        self._add_rms_norm = library.stackpin_add_rms_norm
        self._add_rms_norm.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float, _int, _int]
        self._add_rms_norm.restype = None
        self._rope_cache = library.stackpin_rope_cache
        self._rope_cache.argtypes = [
            _ptr, _i64, _i64, _i64, _i64,  # qkv, tokens, q heads, kv heads, head_dim
            _ptr, _ptr, _i64, _ptr,  # cos, sin, their rows, positions
            _ptr, _i64, _ptr, _ptr, _ptr,  # slots, the caches' rows, q out, k cache, v cache
            _int, _int,  # dtype, threads
        ]  # fmt: skip
        self._rope_cache.restype = _int

    @classmethod
    def load(cls) -> CompiledLayerOps:
        """The compiled ops; a native.BuildError says why not."""
        return cls(native.build(_SOURCE).library)

    @staticmethod
    def serves(*tensors: torch.Tensor) -> bool:
        """Whether the compiled ops take these tensors: on the CPU, all of one dtype, float32 or bfloat16."""
        dtype = tensors[0].dtype
        return dtype in _DTYPES and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _check_norm(x, weight)
        rows, scale = x.contiguous(), weight.contiguous()  # both held until the call returns
        out = torch.empty_like(rows)
        self._rms_norm(
            rows.data_ptr(), scale.data_ptr(), out.data_ptr(), rows.numel() // rows.shape[-1],
            rows.shape[-1], eps, _DTYPES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_norm(x, weight)
        if delta.shape != x.shape:
            raise ValueError(
                f"a residual of shape {tuple(x.shape)} cannot take a delta of {tuple(delta.shape)}"
            )
        rows, deltas, scale = x.contiguous(), delta.contiguous(), weight.contiguous()
        summed, normed = torch.empty_like(rows), torch.empty_like(rows)
        self._add_rms_norm(
            rows.data_ptr(), deltas.data_ptr(), scale.data_ptr(), summed.data_ptr(),
            normed.data_ptr(), rows.numel() // rows.shape[-1], rows.shape[-1], eps, _DTYPES[x.dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        return summed, normed

    def rope_cache(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
        rope_cos: torch.Tensor,  # [positions, D / 2] float32
        rope_sin: torch.Tensor,
        positions: torch.Tensor,  # [T] int64
        slots: torch.Tensor,  # [T] int64
        k_cache: torch.Tensor,  # [blocks, block_size, Hkv, D] in qkv's dtype
        v_cache: torch.Tensor,
    ) -> torch.Tensor:  # q [T, Hq, D]
        n_tokens = qkv.shape[0]
        n_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        n_heads = qkv.shape[1] // head_dim - 2 * n_kv_heads
        if (
            head_dim % 2
            or qkv.shape[1] != (n_heads + 2 * n_kv_heads) * head_dim
            or n_heads <= 0
            or v_cache.shape != k_cache.shape
            or rope_cos.shape != rope_sin.shape
            or rope_cos.shape[-1] != head_dim // 2
            or positions.shape != (n_tokens,)
            or slots.shape != (n_tokens,)
        ):
            raise ValueError(
                f"qkv {tuple(qkv.shape)}, caches {tuple(k_cache.shape)} and {tuple(v_cache.shape)}, rotary tables "
                f"{tuple(rope_cos.shape)} and {n_tokens} tokens' positions {tuple(positions.shape)} and slots "
                f"{tuple(slots.shape)} do not fit together"
            )
        rows = qkv.contiguous()
        cos, sin = rope_cos.contiguous(), rope_sin.contiguous()
        pos, where = positions.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
        q = torch.empty(n_tokens, n_heads, head_dim, dtype=qkv.dtype)
        failed = self._rope_cache(
            rows.data_ptr(), n_tokens, n_heads, n_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
            cos.shape[0], pos.data_ptr(), where.data_ptr(), k_cache.shape[0] * k_cache.shape[1], q.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), _DTYPES[qkv.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise ValueError(
                f"a position falls outside the rotary tables' {cos.shape[0]} rows, or a slot outside the cache's "
                f"{k_cache.shape[0] * k_cache.shape[1]}"
            )
        return q


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"a norm over rows of {x.shape[-1]} takes a weight of that many, not {tuple(weight.shape)}"
        )
