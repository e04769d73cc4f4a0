"""The `batch_invariant` kernel mode on the CPU: every reduction in a fixed order per row, whatever the batch.

The CPU's BLAS picks its blocking, and so the summation order over K, from the number of rows it is given:
a row of `X[:M] @ W` changes in its last bits with M. What holds, and what tests/test_kernels_cpu.py proves
on the machine it runs on, is that a GEMM called with one fixed shape gives each row the same bits whatever
the row's position and whatever the other rows hold. So every matrix product here is issued in blocks of a
fixed number of rows, padded with zeros:
- matmul: the step's rows in blocks of `gemm_rows`;
- attention: each sequence's queries in tiles of `attention_rows`, against the KV length cut into splits of
  `kv_split_size` tokens (a multiple of the cache's block size). Each split yields a partial softmax
  (maximum, sum, weighted values); the partials are merged in split order. A query's splits depend only on
  its own position, so its output is the same whether its cache was filled in one prefill, in chunks or one
  token at a time. A sliding window masks keys by the query's position and skips the splits wholly before it; a
  split that holds no key a row sees merges in as exactly nothing (a row's running maximum stays -inf until it
  sees a key), so a tile may start at the earliest split any of its rows needs. Soft-capped scores are capped
  elementwise; sinks add one logit per head to the sum after the last split.
Row reductions (RMSNorm's mean, log-softmax) reduce each row in the same order however many rows there are,
except that PyTorch splits a reduction across threads when it has a single output; RMSNorm therefore never
reduces one row alone. Attention runs in float32 whatever the cache dtype. The fused families are composed of
elementwise torch ops around this module's `rms_norm` (`kernels.unfused`); an elementwise op gives an element the
same bits wherever it sits. This module knows nothing of the model or scheduling.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pinned_backend.kernels import DEFAULT_KV_SPLIT_SIZE, KernelMode
from pinned_backend.kernels.unfused import UnfusedKernels, softcap

DEFAULT_GEMM_ROWS = 16
DEFAULT_ATTENTION_ROWS = 8
# Bounds the memory of one attention call; how tiles are grouped does not change any tile's result.
_TILES_PER_CALL = 32


class CpuInvariantKernels(UnfusedKernels):
    mode: KernelMode = "batch_invariant"

    def __init__(
        self,
        kv_split_size: int = DEFAULT_KV_SPLIT_SIZE,
        gemm_rows: int = DEFAULT_GEMM_ROWS,
        attention_rows: int = DEFAULT_ATTENTION_ROWS,
    ) -> None:
        for name, value in (
            ("kv_split_size", kv_split_size),
            ("gemm_rows", gemm_rows),
            ("attention_rows", attention_rows),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be a positive number of rows or tokens, got {value}")
        self.kv_split_size = kv_split_size
        self.gemm_rows = gemm_rows
        self.attention_rows = attention_rows
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
        # x [M, K] @ w[N, K].T -> [M, N], issued as ceil(M / gemm_rows) GEMMs of exactly gemm_rows rows.
        self._check_threads()
        rows, width = x.shape
        blocks = -(-rows // self.gemm_rows)
        padded = x.new_zeros(blocks * self.gemm_rows, width)
        padded[:rows] = x
        out = x.new_empty(blocks * self.gemm_rows, w.shape[0])
        w_t = w.t()
        for b in range(blocks):
            block = slice(b * self.gemm_rows, (b + 1) * self.gemm_rows)
            torch.mm(padded[block], w_t, out=out[block])
        return out[:rows]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        squares = x32.pow(2)
        if squares.shape[0] == 1:
            # One output row makes PyTorch split its sum across threads; a second row keeps the row's order.
            squares = torch.cat([squares, squares.new_zeros(squares.shape)])
        mean = squares.mean(-1, keepdim=True)[: x.shape[0]]
        return weight * (x32 * torch.rsqrt(mean + eps)).to(x.dtype)

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
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        self._check_threads()
        block_size = k_cache.shape[1]
        if self.kv_split_size % block_size != 0:
            raise ValueError(
                f"kv_split_size {self.kv_split_size} must be a multiple "
                f"of the KV cache block size {block_size}"
            )
        out = q.new_empty(*q.shape[:2], v_cache.shape[3])
        variant = _Variant(scale, window, softcap)
        tiles = _plan_tiles(
            query_seq.tolist(), query_pos.tolist(), self.attention_rows, self.kv_split_size, window
        )
        # Tiles needing the same splits go together, so padding splits are rare.
        tiles.sort(key=lambda tile: (tile[3], tile[2]))
        for start in range(0, len(tiles), _TILES_PER_CALL):
            group = tiles[start : start + _TILES_PER_CALL]
            self._attend_tiles(q, k_cache, v_cache, block_tables, query_pos, group, variant, sinks, out)
        return out

    def _attend_tiles(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_pos: torch.Tensor,
        tiles: list[_Tile],
        variant: _Variant,
        sinks: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        n_tokens, n_heads, head_dim = q.shape
        n_kv_heads, value_dim = k_cache.shape[2], v_cache.shape[3]
        rows, n_tiles = self.attention_rows, len(tiles)
        blocks_per_split = self.kv_split_size // k_cache.shape[1]
        first, n_splits = min(tile[2] for tile in tiles), max(tile[3] for tile in tiles)

        # Row n_tokens of the padded inputs is a zero query at position -1: it sees no key.
        row_index = torch.full((n_tiles, rows), n_tokens, dtype=torch.long)
        for i, (_, tile_rows, _, _) in enumerate(tiles):
            row_index[i, : len(tile_rows)] = torch.tensor(tile_rows)
        row_index = row_index.to(q.device)
        q_pad = torch.cat([q.float(), q.new_zeros(1, n_heads, head_dim, dtype=torch.float32)])
        pos_pad = torch.cat([query_pos.long(), query_pos.new_full((1,), -1, dtype=torch.long)])
        # [G, R, Hq, D] -> [G, Hkv, group * R, D]: one GEMM per (tile, kv head) with a fixed number of rows.
        q_tiles = (
            q_pad[row_index]
            .reshape(n_tiles, rows, n_kv_heads, n_heads // n_kv_heads, head_dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(n_tiles, n_kv_heads, -1, head_dim)
            .contiguous()
        )
        tile_pos = pos_pad[row_index]  # [G, R]
        width = max(n_splits * blocks_per_split, block_tables.shape[1])
        tables = torch.zeros(block_tables.shape[0], width, dtype=torch.long, device=q.device)
        tables[:, : block_tables.shape[1]] = block_tables.long()
        tile_tables = tables[torch.tensor([tile[0] for tile in tiles], device=q.device)]  # [G, width]

        # Splits before a tile's first one, or after its last, hold no key any of its rows sees: merged in, such a
        # split adds exactly nothing (its maximum is -inf, its sum and values 0), so a row's bits do not depend on
        # the other tiles of its call.
        cache = (k_cache, v_cache)
        m_acc, l_acc, o_acc = self._split(q_tiles, tile_pos, cache, tile_tables, first, variant)
        for j in range(first + 1, n_splits):
            m_split, l_split, o_split = self._split(q_tiles, tile_pos, cache, tile_tables, j, variant)
            # A row that has seen no key keeps its maximum at -inf (shifting by 0 meanwhile): had it taken the 0 it
            # shifts by, the first split it sees would shift by max(0, its maximum), and its bits would follow how
            # many unseen splits its tile happened to start with.
            m_new = torch.maximum(m_acc, m_split)
            shift = _finite(m_new)
            keep, add = torch.exp(m_acc - shift), torch.exp(m_split - shift)
            l_acc = l_acc * keep + l_split * add
            o_acc = o_acc * keep + o_split * add
            m_acc = m_new
        if sinks is not None:
            m_acc, l_acc, o_acc = _with_sinks(m_acc, l_acc, o_acc, sinks, rows)
        result = (
            (o_acc / l_acc)
            .reshape(n_tiles, n_kv_heads, -1, rows, value_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(n_tiles * rows, n_heads, value_dim)
        )
        real = row_index.reshape(-1) < n_tokens
        out[row_index.reshape(-1)[real]] = result[real].to(out.dtype)

    def _split(
        self,
        q_tiles: torch.Tensor,  # [G, Hkv, group * R, D] float32
        tile_pos: torch.Tensor,  # [G, R] position of each tile row, -1 for padding
        cache: tuple[torch.Tensor, torch.Tensor],  # k_cache, v_cache
        tile_tables: torch.Tensor,  # [G, width] block ids of each tile's sequence
        j: int,
        variant: _Variant,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split j's partial softmax per tile row: maximum and sum [G, Hkv, group * R, 1], values [.., Dv]."""
        k_cache, v_cache = cache
        n_tiles, n_kv_heads, group_rows, head_dim = q_tiles.shape
        rows, split = self.attention_rows, self.kv_split_size
        per_split = split // k_cache.shape[1]
        blocks = tile_tables[:, j * per_split : (j + 1) * per_split]  # [G, blocks per split]
        keys = k_cache[blocks].reshape(n_tiles, split, n_kv_heads, head_dim).float()
        values = v_cache[blocks].reshape(n_tiles, split, n_kv_heads, -1).float()
        keys_t = keys.permute(0, 2, 3, 1).contiguous()  # [G, Hkv, D, split]
        values = values.permute(0, 2, 1, 3).contiguous()  # [G, Hkv, split, Dv]
        scores = torch.matmul(q_tiles, keys_t) * variant.scale  # [G, Hkv, group * R, split]
        if variant.softcap is not None:
            scores = softcap(scores, variant.softcap)
        key_pos = torch.arange(j * split, (j + 1) * split, device=q_tiles.device)
        visible = key_pos[None, None, :] <= tile_pos[:, :, None]  # [G, R, split]
        if variant.window is not None:
            visible &= key_pos[None, None, :] > tile_pos[:, :, None] - variant.window
        visible = visible[:, None, None].expand(n_tiles, 1, group_rows // rows, rows, split)
        scores = scores.masked_fill(~visible.reshape(n_tiles, 1, group_rows, split), float("-inf"))
        m_split = scores.amax(-1, keepdim=True)
        probs = torch.exp(scores - _finite(m_split))
        return m_split, probs.sum(-1, keepdim=True), torch.matmul(probs, values)


class _Variant(NamedTuple):
    scale: float
    window: int | None  # a query sees keys pos - window + 1 .. pos
    softcap: float | None


# A tile: (sequence, query rows, first split any row sees, splits up to the last any row sees).
_Tile = tuple[int, list[int], int, int]


def _finite(m: torch.Tensor) -> torch.Tensor:
    # A row that sees no key in a split has maximum -inf; subtracting 0 instead keeps exp() at 0, not NaN.
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def _with_sinks(
    m: torch.Tensor, l_sum: torch.Tensor, o: torch.Tensor, sinks: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The softmax's running (maximum, sum, values) [G, Hkv, group * R, .] after one more logit per head that sees
    no value (gpt-oss's attention sinks): it adds to the sum only."""
    n_kv_heads = m.shape[1]
    sink = sinks.float().reshape(n_kv_heads, -1, 1).expand(-1, -1, rows).reshape(1, n_kv_heads, -1, 1)
    m_new = torch.maximum(m, sink)
    keep = torch.exp(m - m_new)
    return m_new, l_sum * keep + torch.exp(sink - m_new), o * keep


def _plan_tiles(
    query_seq: list[int], query_pos: list[int], rows: int, split: int, window: int | None
) -> list[_Tile]:
    """Cut each sequence's queries into tiles of at most `rows`, each with the splits its rows see."""
    by_seq: dict[int, list[int]] = {}
    for row, seq in enumerate(query_seq):
        by_seq.setdefault(seq, []).append(row)
    tiles = []
    for seq, seq_rows in by_seq.items():
        for start in range(0, len(seq_rows), rows):
            tile_rows = seq_rows[start : start + rows]
            first = (
                0 if window is None else max(0, min(query_pos[r] for r in tile_rows) - window + 1) // split
            )
            tiles.append((seq, tile_rows, first, max(query_pos[r] for r in tile_rows) // split + 1))
    return tiles
