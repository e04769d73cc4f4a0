"""The `batch_invariant` kernel mode on the CPU: every reduction in a fixed order per row, whatever the batch.

The CPU's BLAS picks its blocking, and so the summation order over K, from the number of rows it is given:
a row of `X[:M] @ W` changes in its last bits with M. What holds, and what tests/test_kernels_cpu.py proves
on the machine it runs on, is that a GEMM called with one fixed shape gives each row the same bits whatever
the row's position and whatever the other rows hold. So every matrix product here is issued in blocks of a
fixed number of rows, padded with zeros:
- matmul: the step's rows in blocks of `gemm_rows`, through oneDNN for a weight `prepare` packed
  (kernels.onednn), through the BLAS for any other. A last block of fewer rows is padded with zero rows: to
  `gemm_rows` rows, or through a packed weight to the fewest rows that `prepare` proved give a row the bits of a
  block of `gemm_rows` (onednn.padded_rows, run once per shape at load), so that a decode step of one sequence
  multiplies one or two rows, not sixteen. Through a packed weight, a step of many rows first goes in the widest
  blocks (up to 256 rows) that `prepare` proved give a row those same bits (onednn.wide_blocks), each call reading
  the weight once;
- attention: each query alone over its keys in chunks of `kv_split_size` tokens on a grid of absolute positions, in
  one compiled call a layer (kernels.cpu_paged_attention); where no C compiler can build it, each sequence's queries
  in tiles of `attention_rows`, one GEMM of one shape per tile and split (kernels.cpu_attention), whose bits differ:
  `cpu_kernels` names which serve ("compiled" or "torch"), and the stack says it.
Row reductions (RMSNorm's mean, log-softmax) reduce each row in the same order however many rows there are: RMSNorm
compiled (kernels.cpu_layer_ops), each row alone; in torch ops, PyTorch splits a reduction across threads when it has
a single output, so RMSNorm never reduces one row alone. The fused families are composed of
elementwise torch ops around this module's `rms_norm` (`kernels.unfused`); an elementwise op gives an element the
same bits wherever it sits. This module knows nothing of the model or scheduling.
"""

from __future__ import annotations

import torch

from pinned_backend.kernels import DEFAULT_KV_SPLIT_SIZE, KernelMode, onednn
from pinned_backend.kernels.cpu_attention import SplitAttention
from pinned_backend.kernels.cpu_compiled import compiled_kernels
from pinned_backend.kernels.unfused import UnfusedKernels

DEFAULT_GEMM_ROWS = 16
# The wider blocks `prepare` tries for each packed weight: a step's rows go through the widest proven ones first.
WIDE_BLOCKS = (256, 128, 64, 32)
DEFAULT_ATTENTION_ROWS = 8


class CpuInvariantKernels(UnfusedKernels):
    mode: KernelMode = "batch_invariant"

    def __init__(
        self,
        kv_split_size: int = DEFAULT_KV_SPLIT_SIZE,
        gemm_rows: int = DEFAULT_GEMM_ROWS,
        attention_rows: int = DEFAULT_ATTENTION_ROWS,
        *,
        compiled: bool = True,
    ) -> None:
        """`compiled`: the compiled attention and per-row ops where they build (else, or when False, the split
        attention and torch ops)."""
        if gemm_rows <= 0:
            raise ValueError(f"gemm_rows must be a positive number of rows, got {gemm_rows}")
        self._split = SplitAttention(kv_split_size, attention_rows)
        # The compiled kernels and the torch ops give other bits: the stack names which serve (`cpu_kernels`).
        super().__init__(compiled_kernels(kv_split_size, wanted=compiled))
        self.kv_split_size = kv_split_size  # the stack reports it
        self.gemm_rows = gemm_rows
        # (shape, dtype) of each packed weight -> the rows a last block of m rows is padded to (onednn.padded_rows)
        self._padded_rows: dict[tuple[torch.Size, torch.dtype], tuple[int, ...]] = {}
        # (shape, dtype) of each packed weight -> the wider row counts one call of which `prepare` proved gives a row
        # the bits of a block of gemm_rows (onednn.wide_blocks), largest first
        self._wide_blocks: dict[tuple[torch.Size, torch.dtype], tuple[int, ...]] = {}
        # The BLAS splits a GEMM among threads differently for another thread count, and at larger shapes that
        # changes the bits; the count is therefore part of the stack, fixed when the kernels are made.
        self.threads = torch.get_num_threads()

    def _check_threads(self) -> None:
        now = torch.get_num_threads()
        if now != self.threads:
            raise RuntimeError(
                f"torch's thread count changed from {self.threads} to {now} after the batch_invariant kernels "
                "were made; results would no longer match. Set it once, before selecting kernels."
            )

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x [M, K] @ w[N, K].T -> [M, N], issued as ceil(M / gemm_rows) products of gemm_rows rows (padded).
        self._check_threads()
        rows, width = x.shape
        size = self.gemm_rows
        blocks = -(-rows // size)
        if onednn.is_packed(w):
            return self._packed_matmul(x, w)
        padded = x.new_zeros(blocks * size, width)
        padded[:rows] = x
        out = x.new_empty(blocks * size, w.shape[0])
        w_t = w.t()
        for b in range(blocks):
            block = slice(b * size, (b + 1) * size)
            torch.mm(padded[block], w_t, out=out[block])
        return out[:rows]

    def _packed_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows, size = x.shape[0], self.gemm_rows
        pad_to = self._padded_rows.get((w.shape, w.dtype))
        if pad_to is None:  # packed elsewhere than `prepare`: pad every block to the full size
            pad_to = tuple([0] + [size] * size)
        products = [onednn.linear(x, w)] if rows == 0 else []
        done = 0
        for wide in self._wide_blocks.get((w.shape, w.dtype), ()):  # proven to give a full block's bits
            while rows - done >= wide:
                products.append(onednn.linear(x[done : done + wide], w))
                done += wide
        for start in range(done, rows, size):
            block = x[start : start + size]
            width = pad_to[block.shape[0]]
            if width > block.shape[0]:
                block = torch.cat([block, block.new_zeros(width - block.shape[0], block.shape[1])])
            products.append(onednn.linear(block, w)[: min(size, rows - start)])
        return products[0] if len(products) == 1 else torch.cat(products)

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        packed = onednn.pack(w, self.gemm_rows)
        if onednn.is_packed(packed) and (packed.shape, packed.dtype) not in self._padded_rows:
            self._check_threads()
            self._padded_rows[packed.shape, packed.dtype] = onednn.padded_rows(packed, self.gemm_rows)
            self._wide_blocks[packed.shape, packed.dtype] = onednn.wide_blocks(
                packed, self.gemm_rows, WIDE_BLOCKS
            )
        return packed

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ops = self.compiled.layer_ops
        if ops is not None and ops.serves(x, weight):
            return ops.rms_norm(x, weight, eps)
        x32 = x.float()
        squares = x32.pow(2)
        if squares.shape[0] == 1:
            # One output row makes PyTorch split its sum across threads; a second row keeps the row's order.
            squares = torch.cat([squares, squares.new_zeros(squares.shape)])
        mean = squares.mean(-1, keepdim=True)[: x.shape[0]]
        return weight * (x32 * torch.rsqrt(mean + eps)).to(x.dtype)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.float(), dim=-1)

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
        attend = self.compiled.attention
        if attend is None:
            return super().latent_attention(q, cache, block_tables, query_seq, query_pos, scale, v_dim)
        self._check_threads()
        # A value element's sum never reads another element: only the first v_dim are computed.
        return attend(q, cache, cache, block_tables, query_seq, query_pos, scale, value_dim=v_dim)

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
    ) -> torch.Tensor:
        self._check_threads()
        attend = self.compiled.attention or self._split
        if self.kv_split_size % k_cache.shape[1] != 0:  # a configuration either attention refuses alike
            raise ValueError(
                f"kv_split_size {self.kv_split_size} must be a multiple "
                f"of the KV cache block size {k_cache.shape[1]}"
            )
        return attend(
            q, k_cache, v_cache, block_tables, query_seq, query_pos, scale,
            window=window, sinks=sinks, softcap=softcap,
        )  # fmt: skip
