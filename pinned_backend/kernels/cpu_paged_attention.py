"""The CPU's attention over the paged KV cache as one compiled call a layer (`cpu_paged_attention.c`): each query
alone, its keys in chunks on a grid of absolute positions, so that its bits depend on its own position and the keys
it sees, never on the step around it. It reads the cache where it lies, in its own dtype, with no gathered or
widened copy.

`CompiledAttention.load` builds the library (kernels.native); where that cannot be done it says why, and the
kernels fall back to the split attention of torch ops (kernels.cpu_attention), whose bits differ: the stack names
which one serves.
"""

from __future__ import annotations

import ctypes

import torch

from pinned_backend.kernels import native

_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SOURCE = native.SOURCES / "cpu_paged_attention.c"
NAME = "compiled"  # how the stack names this attention

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [
    _ptr, ctypes.c_int, _i64, _i64, _i64,  # q, its dtype, tokens, heads, head_dim
    _ptr, _ptr, ctypes.c_int, _i64, _i64,  # k_cache, v_cache, dtype, blocks, block_size
    _i64, _i64, _i64, _i64,  # kv heads, key width, value width, value_dim
    _ptr, _i64, _i64, _ptr, _ptr,  # block_tables, sequences, table width, query_seq, query_pos
    _f32, _f32, _i64, _ptr, _i64,  # scale, softcap, window, sinks, chunk
    _ptr, ctypes.c_int, ctypes.c_int,  # out, its dtype, threads
]  # fmt: skip


class CompiledAttention:
    def __init__(self, library: ctypes.CDLL, chunk: int) -> None:
        if chunk <= 0:
            raise ValueError(f"the attention's key chunk must be a positive number of tokens, got {chunk}")
        self.chunk = chunk
        self._call = library.stackpin_paged_attention
        self._call.argtypes = _ARGTYPES
        self._call.restype = ctypes.c_int

    @classmethod
    def load(cls, chunk: int) -> CompiledAttention:
        """The compiled attention with keys in chunks of `chunk` tokens; a native.BuildError says why not."""
        return cls(native.build(_SOURCE).library, chunk)

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [blocks, block_size, Hkv, Dk]
        v_cache: torch.Tensor,  # [blocks, block_size, Hkv, Dv]
        block_tables: torch.Tensor,  # [S, W] int32
        query_seq: torch.Tensor,  # [T] int32
        query_pos: torch.Tensor,  # [T] int32
        scale: float,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
        value_dim: int | None = None,
    ) -> torch.Tensor:  # [T, Hq, value_dim] in q's dtype
        """`value_dim`: a value's first elements, where the cache is both keys and values (latent attention)."""
        if (
            k_cache.dtype not in _CACHE_DTYPES
            or v_cache.dtype != k_cache.dtype
            or q.dtype not in _CACHE_DTYPES
        ):
            raise ValueError(
                "the compiled attention reads float32, bfloat16 or float16 queries and caches, not "
                f"{q.dtype} queries over a {k_cache.dtype} cache"
            )
        if k_cache.device.type != "cpu" or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the compiled attention reads contiguous caches in CPU memory")
        n_tokens, n_heads, head_dim = q.shape
        n_kv_heads, value_width = k_cache.shape[2], v_cache.shape[3]
        value_dim = value_width if value_dim is None else value_dim
        if (
            n_heads % n_kv_heads
            or head_dim != k_cache.shape[3]
            or not 0 < value_dim <= value_width
            or v_cache.shape[:3] != k_cache.shape[:3]
        ):
            raise ValueError(
                f"queries [T, {n_heads}, {head_dim}] do not fit a cache of {n_kv_heads} KV heads of "
                f"{k_cache.shape[3]} and values of {value_width} (value_dim {value_dim}), keys "
                f"{tuple(k_cache.shape)} and values {tuple(v_cache.shape)}"
            )
        if sinks is not None and sinks.numel() != n_heads:
            raise ValueError(f"{sinks.numel()} attention sinks for {n_heads} query heads")
        queries = q.detach().contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        seqs, positions = query_seq.to(torch.int32).contiguous(), query_pos.to(torch.int32).contiguous()
        sink_logits = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
        # The kernel writes float32 or bfloat16; a float16 result is rounded from float32 here.
        out_dtype = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = torch.empty(n_tokens, n_heads, value_dim, dtype=out_dtype)
        if n_tokens:
            failed = self._call(
                queries.data_ptr(), _CACHE_DTYPES[queries.dtype], n_tokens, n_heads, head_dim,
                k_cache.data_ptr(), v_cache.data_ptr(), _CACHE_DTYPES[k_cache.dtype], k_cache.shape[0],
                k_cache.shape[1], n_kv_heads, k_cache.shape[3], value_width, value_dim,
                tables.data_ptr(), tables.shape[0], tables.shape[1], seqs.data_ptr(), positions.data_ptr(),
                scale, softcap or 0.0, window or 0, 0 if sink_logits is None else sink_logits.data_ptr(), self.chunk,
                out.data_ptr(), _CACHE_DTYPES[out_dtype], torch.get_num_threads(),
            )  # fmt: skip
            if failed == -2:
                raise ValueError(
                    "a query's sequence, position or cache block falls outside the block tables "
                    f"{tuple(tables.shape)} or the cache's {k_cache.shape[0]} blocks"
                )
            if failed:
                raise MemoryError("the compiled attention could not allocate its scratch memory")
        return out if out.dtype == q.dtype else out.to(q.dtype)
