"""The CPU's attention over the paged KV cache in fixed-shape pieces: the batch_invariant set's, and the default
set's when a step holds several sequences.

Each sequence's queries go in tiles of `rows` (the tile rows that no query fills are zero queries), against the KV
length cut into splits of `kv_split_size` tokens (a multiple of the cache's block size). Every (KV head, tile, split)
is one GEMM of one shape, [group * rows, D] @ [D, split] for the scores and [group * rows, split] @ [split, Dv] for
the values, so that a query's bits never depend on the other rows of its tile, the other tiles of its call or how
many there are (a GEMM of one shape gives each row the same bits: tests/test_kernels_cpu.py). Each split yields a
partial softmax (maximum, sum, weighted values); the partials are merged in split order. A query's splits depend
only on its own position, so its output is the same whether its cache was filled in one prefill, in chunks or one
token at a time. A sliding window masks keys by the query's position and skips the splits wholly before it; a split
that holds no key a row sees merges in as exactly nothing (a row's running maximum stays -inf until it sees a key),
so a tile may start at the earliest split any of its rows needs. Soft-capped scores are capped elementwise; sinks
add one logit per head to the sum after the last split. Everything runs in float32 whatever the cache's dtype.

What the pieces read besides the layer's queries and cache (the tiles, the cache blocks of their keys, the masks)
depends only on the step's positions, sequences and block tables, so it is planned once a step, at the first layer
(kernels.step_memo). The elementwise softmax runs only over the tile rows some tile of a call uses: a decode step's
tiles hold one query each, and their padding rows would otherwise cost most of the work.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pinned_backend.kernels.step_memo import StepMemo
from pinned_backend.kernels.unfused import softcap

# Bounds one call's (tile, split) pieces, and so its memory: a call's tensors stay within the caches. How tiles are
# grouped into calls does not change any tile's result.
_PIECES_PER_CALL = 32


class SplitAttention:
    def __init__(self, kv_split_size: int, rows: int) -> None:
        for name, value in (("kv_split_size", kv_split_size), ("attention_rows", rows)):
            if value <= 0:
                raise ValueError(f"{name} must be a positive number of rows or tokens, got {value}")
        self.kv_split_size = kv_split_size
        self.attention_rows = rows
        self._plans = StepMemo()

    def __call__(
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
        block_size = k_cache.shape[1]
        if self.kv_split_size % block_size != 0:
            raise ValueError(
                f"kv_split_size {self.kv_split_size} must be a multiple "
                f"of the KV cache block size {block_size}"
            )
        n_tokens, n_heads, head_dim = q.shape
        group = n_heads // k_cache.shape[2]
        calls = self._plans.get(
            (query_seq, query_pos, block_tables),
            (window, block_size, group),
            lambda: self._plan(query_seq, query_pos, block_tables, block_size, group, window),
        )
        out = q.new_empty(n_tokens, n_heads, v_cache.shape[3])
        # Row n_tokens of the padded queries is a zero query at position -1: it sees no key.
        q_pad = torch.cat([q.float(), q.new_zeros(1, n_heads, head_dim, dtype=torch.float32)])
        variant = _Variant(scale, softcap)
        for call in calls:
            self._attend(q_pad, k_cache, v_cache, call, variant, sinks, out)
        return out

    def _plan(
        self,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        group: int,
        window: int | None,
    ) -> list[_Call]:
        """The step's tiles in calls of at most _PIECES_PER_CALL (tile, split) pieces, with what every layer's call
        reads: which query rows each tile holds, and per split the cache blocks its keys sit in and which of them each
        row sees."""
        rows, split = self.attention_rows, self.kv_split_size
        n_tokens = query_seq.shape[0]
        device = query_pos.device
        tiles = _plan_tiles(query_seq.tolist(), query_pos.tolist(), rows, split, window)
        # Tiles needing the same splits and rows go together, so padding splits and rows are rare.
        tiles.sort(key=lambda tile: (tile[3], tile[2], len(tile[1])))
        pos_pad = torch.cat([query_pos.long(), query_pos.new_full((1,), -1, dtype=torch.long)])
        blocks_per_split = split // block_size
        calls = []
        for chunk in _calls(tiles):
            n_tiles = len(chunk)
            first, n_splits = min(tile[2] for tile in chunk), max(tile[3] for tile in chunk)
            used = max(len(tile[1]) for tile in chunk)  # tile rows past this hold no query in any tile
            row_index = torch.full((n_tiles, used), n_tokens, dtype=torch.long)
            for i, (_, tile_rows, _, _) in enumerate(chunk):
                row_index[i, : len(tile_rows)] = torch.tensor(tile_rows)
            row_index = row_index.to(device)
            tile_pos = pos_pad[row_index]  # [G, R']
            width = max(n_splits * blocks_per_split, block_tables.shape[1])
            tables = torch.zeros(block_tables.shape[0], width, dtype=torch.long, device=device)
            tables[:, : block_tables.shape[1]] = block_tables.long()
            tile_tables = tables[torch.tensor([tile[0] for tile in chunk], device=device)]  # [G, width]
            # Splits before a tile's first one, or after its last, hold no key any of its rows sees: merged in,
            # such a split adds exactly nothing (its maximum is -inf, its sum and values 0), so a row's bits do not
            # depend on the other tiles of its call.
            blocks = tile_tables[:, first * blocks_per_split : n_splits * blocks_per_split]
            key_pos = torch.arange(first * split, n_splits * split, device=device)
            visible = key_pos[None, None, :] <= tile_pos[:, :, None]  # [G, R', n * split]
            if window is not None:
                visible &= key_pos[None, None, :] > tile_pos[:, :, None] - window
            # [1, G, n, 1, R', split]: by KV head, tile, split, query head of the group, tile row
            by_split = visible.reshape(n_tiles, used, n_splits - first, split).transpose(1, 2)
            hidden = ~by_split[None, :, :, None]
            flat = row_index.reshape(-1)
            real = flat < n_tokens
            calls.append(_Call(row_index, blocks, hidden, torch.nonzero(real).squeeze(1), flat[real]))
        return calls

    def _attend(
        self,
        q_pad: torch.Tensor,  # [T + 1, Hq, D] float32, a zero query last
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        call: _Call,
        variant: _Variant,
        sinks: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        n_heads, head_dim = q_pad.shape[1], q_pad.shape[2]
        n_kv_heads, value_dim = k_cache.shape[2], v_cache.shape[3]
        rows, group = self.attention_rows, n_heads // n_kv_heads
        n_tiles, used = call.row_index.shape
        n_splits, split = call.hidden.shape[2], call.hidden.shape[5]
        row_index = call.row_index
        if used < rows:  # the rest of each tile: zero queries, as padding
            row_index = torch.cat(
                [row_index, row_index.new_full((n_tiles, rows - used), q_pad.shape[0] - 1)], 1
            )
        # [G, R, Hq, D] -> [Hkv, G, 1, group * R, D]: one GEMM per (KV head, tile, split) with a fixed number of rows.
        q_tiles = (
            torch.index_select(q_pad, 0, row_index.reshape(-1))
            .reshape(n_tiles, rows, n_kv_heads, group, head_dim)
            .permute(2, 0, 3, 1, 4)
            .reshape(n_kv_heads, n_tiles, 1, group * rows, head_dim)
        )
        # Gathered by KV head first: keys [Hkv, G, n, D, split], values [Hkv, G, n, split, Dv], each in one copy. The
        # products read both contiguous: MKL's batched GEMM reading the keys transposed in place gave a row other bits
        # from one step to another (the engine's invariance tests caught it).
        keys_t = _by_head(_gather(k_cache, call.blocks), n_splits, split, transposed=True)
        split_values = _by_head(_gather(v_cache, call.blocks), n_splits, split, transposed=False)
        # [Hkv, G, n, group, R, split]; the softmax reads only the tile rows some tile of the call uses
        scores = torch.matmul(q_tiles, keys_t).reshape(n_kv_heads, n_tiles, n_splits, group, rows, split)
        scores = scores[:, :, :, :, :used] * variant.scale
        if variant.softcap is not None:
            scores = softcap(scores, variant.softcap)
        scores = scores.masked_fill(call.hidden, float("-inf"))
        m_all = scores.amax(-1, keepdim=True)
        shifted = scores - _finite(m_all)
        if used < rows:  # the padding rows' probabilities are zeros around the used rows', in one buffer
            padded = scores.new_zeros(*scores.shape[:4], rows, split)
            probs = torch.exp(shifted, out=padded[:, :, :, :, :used])
        else:
            probs = padded = torch.exp(shifted)
        l_all = probs.sum(-1, keepdim=True)
        o_all = torch.matmul(padded.reshape(n_kv_heads, n_tiles, n_splits, group * rows, split), split_values)
        o_all = o_all.reshape(n_kv_heads, n_tiles, n_splits, group, rows, value_dim)[:, :, :, :, :used]
        m_acc, l_acc, o_acc = m_all[:, :, 0], l_all[:, :, 0], o_all[:, :, 0]
        for j in range(1, n_splits):
            m_split, l_split, o_split = m_all[:, :, j], l_all[:, :, j], o_all[:, :, j]
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
            m_acc, l_acc, o_acc = _with_sinks(m_acc, l_acc, o_acc, sinks)
        # [Hkv, G, group, R', Dv] -> [G * R', Hq, Dv]
        result = (o_acc / l_acc).permute(1, 3, 0, 2, 4).reshape(n_tiles * used, n_heads, value_dim)
        out.index_copy_(0, call.dest, torch.index_select(result, 0, call.source).to(out.dtype))


class _Variant(NamedTuple):
    scale: float
    softcap: float | None


class _Call(NamedTuple):
    """One attention call's share of a step, the same at every layer."""

    row_index: torch.Tensor  # [G, R'] the query row each tile row holds; T (a zero query) for padding
    blocks: torch.Tensor  # [G, n * split / block size] the cache blocks of the call's n splits, per tile
    hidden: torch.Tensor  # [1, G, n, 1, R', split] True where a tile row does not see the key
    source: torch.Tensor  # the flattened tile rows that hold a query...
    dest: torch.Tensor  # ...and the query rows they hold


# A tile: (sequence, query rows, first split any row sees, splits up to the last any row sees).
_Tile = tuple[int, list[int], int, int]


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] for a block index [G, B]: [G, B, block size, Hkv, D]. index_select copies each whole block at
    once, where indexing with a tensor computes every element's address (several times slower)."""
    return torch.index_select(cache, 0, blocks.reshape(-1)).view(*blocks.shape, *cache.shape[1:])


def _by_head(blocks: torch.Tensor, n_splits: int, split: int, *, transposed: bool) -> torch.Tensor:
    """Gathered cache blocks [G, n * blocks per split, block size, Hkv, D] as contiguous float32 [Hkv, G, n, split, D],
    or [Hkv, G, n, D, split] `transposed`, in one copy (whole blocks gather as contiguous rows)."""
    n_tiles, _, _, n_kv_heads, width = blocks.shape
    by_split = blocks.view(n_tiles, n_splits, split, n_kv_heads, width)
    order = (3, 0, 1, 4, 2) if transposed else (3, 0, 1, 2, 4)
    permuted = by_split.permute(*order)
    if not transposed:  # rows of D stay whole: reordered and widened in one pass over memory
        return torch.empty(permuted.shape, dtype=torch.float32, device=blocks.device).copy_(permuted)
    # A transposing copy that also widens runs element by element: the keys are reordered in the cache's dtype, then
    # widened. A gathered block tensor is the call's own, so even where `contiguous` copies nothing the result is
    # never the cache.
    return permuted.contiguous().float()


def _finite(m: torch.Tensor) -> torch.Tensor:
    # A row that sees no key in a split has maximum -inf; subtracting 0 instead keeps exp() at 0, not NaN.
    return m.nan_to_num(neginf=0.0)


def _with_sinks(
    m: torch.Tensor, l_sum: torch.Tensor, o: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The softmax's running (maximum, sum, values) [Hkv, G, group, R', .] after one more logit per head that sees
    no value (gpt-oss's attention sinks): it adds to the sum only."""
    sink = sinks.float().reshape(m.shape[0], 1, m.shape[2], 1, 1)
    m_new = torch.maximum(m, sink)
    keep = torch.exp(m - m_new)
    return m_new, l_sum * keep + torch.exp(sink - m_new), o * keep


def _calls(tiles: list[_Tile]) -> list[list[_Tile]]:
    """Sorted tiles grouped into calls of at most _PIECES_PER_CALL pieces (one tile at least)."""
    calls: list[list[_Tile]] = []
    first, last = 0, 0
    for tile in tiles:
        if calls:
            grown_first, grown_last = min(first, tile[2]), max(last, tile[3])
            if (len(calls[-1]) + 1) * (grown_last - grown_first) <= _PIECES_PER_CALL:
                calls[-1].append(tile)
                first, last = grown_first, grown_last
                continue
        calls.append([tile])
        first, last = tile[2], tile[3]
    return calls


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
