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
            _ptr,
            _i64,
            _i64,
            _i64,
            _i64,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _int,
            _int,
        ]
        self._rope_cache.restype = None

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
        rows = x.contiguous()
        out = torch.empty_like(rows)
        self._rms_norm(
            rows.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(), rows.numel() // rows.shape[-1],
            rows.shape[-1], eps, _DTYPES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, deltas = x.contiguous(), delta.contiguous()
        summed, normed = torch.empty_like(rows), torch.empty_like(rows)
        self._add_rms_norm(
            rows.data_ptr(), deltas.data_ptr(), weight.contiguous().data_ptr(), summed.data_ptr(),
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
        rows = qkv.contiguous()
        cos, sin = rope_cos.contiguous(), rope_sin.contiguous()
        pos, where = positions.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
        q = torch.empty(n_tokens, n_heads, head_dim, dtype=qkv.dtype)
        self._rope_cache(
            rows.data_ptr(), n_tokens, n_heads, n_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
            pos.data_ptr(), where.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            _DTYPES[qkv.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return q
