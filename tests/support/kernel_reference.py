"""Float64 reference implementations of the kernel families, for tests to measure the fast ones against.

Written for clarity, not speed: one query at a time, every reduction in float64. The results come back in
float64; a test decides what tolerance fits the dtype under test. Serving never calls it: it lives with the tests."""

from __future__ import annotations

import torch


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # x [M, K], w [N, K] -> [M, N]
    return x.double() @ w.double().T


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [M, D], weight [D] -> [M, D]
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    # x [M, V] -> [M, V]
    return torch.log_softmax(x.double(), dim=-1)


def attention(
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
    # q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] -> [T, Hq, Dv]; the variants as the kernels'
    n_tokens, n_heads, _ = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    out = torch.empty(n_tokens, n_heads, v_cache.shape[3], dtype=torch.float64)
    for t in range(n_tokens):
        seq, pos = int(query_seq[t]), int(query_pos[t])
        positions = torch.arange(0 if window is None else max(0, pos - window + 1), pos + 1)
        blocks = block_tables[seq, positions // block_size].long()
        keys = k_cache[blocks, positions % block_size].double()  # [L, Hkv, D]
        values = v_cache[blocks, positions % block_size].double()
        keys = keys.repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t].double(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=-1)
        probs = torch.softmax(scores, dim=-1)[:, : positions.numel()]
        out[t] = torch.einsum("hl,lhd->hd", probs, values)
    return out
