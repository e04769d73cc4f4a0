"""The `default` kernel mode on the CPU: plain PyTorch ops, as fast as the library makes them, not batch invariant.

This is what an ordinary server runs (on CUDA, `default` is cuBLAS over the Triton kernels: `kernels.triton`).
The reduction order of each op is whatever PyTorch picks for the shapes of the step, so a row's result may change
with the batch around it; the `batch_invariant` modes exist to fix that. The fused families are the torch ops they
fuse (`kernels.unfused`). It knows nothing of the model beyond the shapes in `pinned_backend.kernels`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pinned_backend.kernels import DEFAULT_KV_SPLIT_SIZE, KernelMode, onednn
from pinned_backend.kernels.cpu_attention import SplitAttention
from pinned_backend.kernels.cpu_compiled import compiled_kernels
from pinned_backend.kernels.unfused import UnfusedKernels, softcap

# The rows a packed weight is laid out for: a hint to oneDNN, which multiplies any number of rows either way.
_PACKED_FOR_ROWS = 16
# Attention goes to the compiled attention (kernels.cpu_paged_attention), which reads the paged cache in place and is
# faster than the alternatives below at every step shape measured. Where it does not build: several decoding
# sequences in the split attention's fixed pieces (kernels.cpu_attention), faster than a call per sequence from two
# sequences on; a sequence alone, or prefilling, in scaled_dot_product_attention, whose causal kernel prefills faster
# than the pieces.
_SPLIT_ROWS = 8


class TorchKernels(UnfusedKernels):
    mode: KernelMode = "default"

    def __init__(self, *, compiled: bool = True) -> None:
        """`compiled`: the compiled attention and per-row ops where they build (else, or when False, torch ops and
        the fallbacks below)."""
        super().__init__(compiled_kernels(DEFAULT_KV_SPLIT_SIZE, wanted=compiled))
        self._batched = SplitAttention(DEFAULT_KV_SPLIT_SIZE, _SPLIT_ROWS)

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return onednn.linear(x, w) if onednn.is_packed(w) else F.linear(x, w)

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return onednn.pack(w, _PACKED_FOR_ROWS)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ops = self.compiled.layer_ops
        if ops is not None and ops.serves(x, weight):
            return ops.rms_norm(x, weight, eps)
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
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        variants: dict[str, Any] = {"window": window, "sinks": sinks, "softcap": softcap}
        if self.compiled.attention is not None:
            return self.compiled.attention(
                q, k_cache, v_cache, block_tables, query_seq, query_pos, scale, **variants
            )
        n_seqs = block_tables.shape[0]
        if n_seqs == 1:
            return self._one_sequence(q, k_cache, v_cache, block_tables, 0, query_pos, scale, **variants)
        if DEFAULT_KV_SPLIT_SIZE % k_cache.shape[1] != 0:
            return self._one_by_one(
                q, k_cache, v_cache, block_tables, query_seq, query_pos, scale, **variants
            )
        # Sequences decoding (one query each) together in the split attention; a sequence prefilling (several
        # queries) through scaled_dot_product_attention, whose causal kernel prefills faster.
        several = torch.bincount(query_seq, minlength=n_seqs)[query_seq.long()] > 1
        if not bool(several.any()):
            return self._batched(q, k_cache, v_cache, block_tables, query_seq, query_pos, scale, **variants)
        out = self._one_by_one(
            q, k_cache, v_cache, block_tables, query_seq, query_pos, scale, several, **variants
        )
        decoding = torch.nonzero(~several).squeeze(1)
        if decoding.numel():
            step = (query_seq[decoding], query_pos[decoding])
            out[decoding] = self._batched(
                q[decoding], k_cache, v_cache, block_tables, *step, scale, **variants
            )
        return out

    def _one_by_one(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        scale: float,
        among: torch.Tensor | None = None,
        **variants: Any,
    ) -> torch.Tensor:
        """Attention of the sequences whose rows `among` marks (all where None), one call per sequence; the other
        rows are left unwritten."""
        out = q.new_empty(*q.shape[:2], v_cache.shape[3])
        chosen = query_seq if among is None else query_seq[among]
        for seq in torch.unique(chosen).tolist():
            rows = torch.nonzero(query_seq == seq).squeeze(1)
            out[rows] = self._one_sequence(
                q[rows], k_cache, v_cache, block_tables, seq, query_pos[rows], scale, **variants
            )
        return out

    def _one_sequence(
        self,
        q: torch.Tensor,  # [Tq, Hq, D], every query of sequence `seq` in this step
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq: int,
        query_pos: torch.Tensor,
        scale: float,
        *,
        window: int | None,
        sinks: torch.Tensor | None,
        softcap: float | None,
    ) -> torch.Tensor:  # [Tq, Hq, Dv]
        """One sequence's attention over its gathered cache: scaled_dot_product_attention where it computes the
        variant, the softmax spelled out where it does not (soft-capped scores, sinks)."""
        block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
        pos = query_pos.long()
        if pos.numel() == 0:
            return q.new_empty(0, q.shape[1], v_cache.shape[3])
        length = int(pos.max()) + 1
        blocks = block_tables[seq, : -(-length // block_size)].long()
        keys = torch.index_select(k_cache, 0, blocks).reshape(-1, n_kv_heads, k_cache.shape[3])[:length]
        values = torch.index_select(v_cache, 0, blocks).reshape(-1, n_kv_heads, v_cache.shape[3])[:length]
        query = q.transpose(0, 1)  # [Hq, Tq, D]
        if sinks is None and softcap is None:
            attended = F.scaled_dot_product_attention(
                query,
                keys.transpose(0, 1),
                values.transpose(0, 1),
                scale=scale,
                enable_gqa=True,
                **_causal(pos, length, window),
            )
        else:
            attended = _spelled_out(query, keys, values, _mask(pos, length, window), scale, sinks, softcap)
        return attended.transpose(0, 1).contiguous()


def _mask(pos: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """[Tq, L] True where a query at `pos` sees the key."""
    key_pos = torch.arange(length, device=pos.device)[None, :]
    mask = key_pos <= pos[:, None]
    if window is not None:
        mask &= key_pos > pos[:, None] - window
    return mask


def _causal(pos: torch.Tensor, length: int, window: int | None) -> dict[str, Any]:
    """scaled_dot_product_attention's masking for queries at `pos` over `length` keys: none for one query at the
    last position (it sees every key), its own causal mask for a whole prompt, an explicit mask otherwise."""
    if window is None or window >= length:
        if pos.shape[0] == 1 and int(pos[0]) == length - 1:
            return {}
        if pos.shape[0] == length and torch.equal(pos, torch.arange(length, device=pos.device)):
            return {"is_causal": True}  # positions 0 .. length - 1 in order: the rows' own causal triangle
    return {"attn_mask": _mask(pos, length, window)}


def _spelled_out(
    q: torch.Tensor,  # [Hq, Tq, D]
    keys: torch.Tensor,  # [L, Hkv, D]
    values: torch.Tensor,  # [L, Hkv, Dv]
    mask: torch.Tensor,  # [Tq, L]
    scale: float,
    sinks: torch.Tensor | None,  # [Hq]
    cap: float | None,
) -> torch.Tensor:  # [Hq, Tq, Dv]
    group = q.shape[0] // keys.shape[1]
    k = keys.transpose(0, 1).repeat_interleave(group, dim=0)
    v = values.transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)).float() * scale
    if cap is not None:
        scores = softcap(scores, cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)
