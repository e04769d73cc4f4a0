"""Does cutting K chains between persistent Gluon programs win the sizes where a matmul's last round is part empty?

The worst matmul sizes (bench/results/h200.md, "Matmul against cuBLAS") sit just past a multiple of a tile's rows:
a last round of tiles leaves most multiprocessors idle, or the tiles are fewer than the multiprocessors and each
walks a chain as long as K. `_streamed_kernel` gives every program an equal run of (tile, K step) units, as the
served `tl.dot` streamed tile does (pinned_backend/kernels/triton/matmul.py), but with the Gluon pipeline of
matmul_gluon.py: a chain cut between two programs passes its fp32 accumulator through a carry slot and a flag, an
exact value, so it goes through the very steps one program would take it through. One slice of K only.

A program first runs the chain it leaves unfinished (and publishes its accumulator), then its whole chains, then
continues the chain the program before it left, so it seldom waits. Its copies run ahead across all three, in that
order. All programs must be resident at once (at most one per multiprocessor), since one may wait on another.

Usage: python bench/gluon_stream_probe.py OUT.json. Times each tile streamed, against the same tile from the
persistent Gluon kernel, the served plan and cuBLAS, at the sizes where the plans are worst, with bits compared
with the plan's. Writes JSON as it goes.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from gpu_kernels import time_rotating, weight_copies
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

mm = importlib.import_module("pinned_backend.kernels.triton.matmul")
mp = importlib.import_module("pinned_backend.kernels.triton.matmul_plans")
mg = importlib.import_module("pinned_backend.kernels.triton.matmul_gluon")


@gluon.jit
def _unit_at(q, lead_lo, lead, carried_hi, whole, lo):
    """The (tile, K step) unit a program takes q-th: its leaving chain, then its whole chains, then the carried one."""
    in_lead = (q < lead).to(gl.int32)
    in_whole = ((q >= lead) & (q < lead + whole)).to(gl.int32)
    in_carried = (q >= lead + whole).to(gl.int32)
    return in_lead * (lead_lo + q) + in_whole * (carried_hi + q - lead) + in_carried * (lo + q - lead - whole)


@gluon.jit
def _copy_unit(x_desc, w_desc, x_stages, w_stages, filled, q, k, off_m, off_n):
    depth: gl.constexpr = x_stages.shape[0]
    stage = q % depth
    k_at = k * x_desc.block_type.shape[1]
    mbarrier.expect(filled.index(stage), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [off_m, k_at], filled.index(stage), x_stages.index(stage))
    tma.async_copy_global_to_shared(w_desc, [off_n, k_at], filled.index(stage), w_stages.index(stage))


@gluon.jit
def _step(x_stages, w_stages, filled, acc, q, use_acc):
    depth: gl.constexpr = x_stages.shape[0]
    stage = q % depth
    mbarrier.wait(filled.index(stage), (q // depth) & 1)
    acc = warpgroup_mma(
        x_stages.index(stage), w_stages.index(stage).permute((1, 0)), acc, use_acc=use_acc, is_async=True
    )
    return warpgroup_mma_wait(num_outstanding=1, deps=(acc,))


@gluon.jit
def _copy_ahead(
    x_desc, w_desc, x_stages, w_stages, filled, q, n, lead_lo, lead, carried_hi, whole, lo, ahead_tile, ahead_m,
    ahead_n, M, STEPS: gl.constexpr, N_TILES: gl.constexpr, GROUP_M: gl.constexpr,
):  # fmt: skip
    depth: gl.constexpr = x_stages.shape[0]
    # Every warpgroup's step before this one has finished: its stage takes the copy depth - 1 ahead.
    gl.thread_barrier()
    ahead = q + depth - 1
    if ahead < n:
        unit = _unit_at(ahead, lead_lo, lead, carried_hi, whole, lo)
        if unit // STEPS != ahead_tile:
            ahead_tile = unit // STEPS
            ahead_m, ahead_n = mg._tile_origin(
                ahead_tile, M, x_stages.shape[1], w_stages.shape[1], N_TILES, GROUP_M
            )
        _copy_unit(x_desc, w_desc, x_stages, w_stages, filled, ahead, unit % STEPS, ahead_m, ahead_n)
    return ahead_tile, ahead_m, ahead_n


@gluon.jit(do_not_specialize=["M", "RUN"])
def _streamed_kernel(
    x_desc, w_desc, out_desc, carry_ptr, flags_ptr, M, RUN,
    STEPS: gl.constexpr, DEPTH: gl.constexpr, N_TILES: gl.constexpr, GROUP_M: gl.constexpr, PDL: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    block_m: gl.constexpr = x_desc.block_type.shape[0]
    block_n: gl.constexpr = w_desc.block_type.shape[0]
    pid = gl.program_id(0)
    units = gl.cdiv(M, block_m) * N_TILES * STEPS
    lo = pid * RUN
    hi = gl.minimum(lo + RUN, units)
    carried_hi = gl.minimum(
        gl.cdiv(lo, STEPS) * STEPS, hi
    )  # [lo, carried_hi): continued from the program before
    last_lo = (hi - 1) // STEPS * STEPS
    leaves = (hi - last_lo < STEPS) & (last_lo >= carried_hi)
    lead_lo = last_lo * leaves.to(gl.int32) + hi * (
        1 - leaves.to(gl.int32)
    )  # [lead_lo, hi): left to the next
    lead = hi - lead_lo
    whole = lead_lo - carried_hi
    n = hi - lo

    x_stages, w_stages, filled, out_stage = mg._allocate_ring(x_desc, w_desc, out_desc, DEPTH)
    acc_layout: gl.constexpr = mg._acc_layout(block_m, block_n, num_warps)
    rows = gl.arange(0, block_m, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, block_n, layout=gl.SliceLayout(0, acc_layout))
    carry_offsets = rows[:, None] * block_n + cols[None, :]
    mg._start_as_dependent(PDL)

    first_unit = _unit_at(0, lead_lo, lead, carried_hi, whole, lo)
    ahead_tile = first_unit // STEPS
    ahead_m, ahead_n = mg._tile_origin(ahead_tile, M, block_m, block_n, N_TILES, GROUP_M)
    for p in gl.static_range(DEPTH - 1):
        if p < n:
            unit = _unit_at(p, lead_lo, lead, carried_hi, whole, lo)
            if unit // STEPS != ahead_tile:
                ahead_tile = unit // STEPS
                ahead_m, ahead_n = mg._tile_origin(ahead_tile, M, block_m, block_n, N_TILES, GROUP_M)
            _copy_unit(x_desc, w_desc, x_stages, w_stages, filled, p, unit % STEPS, ahead_m, ahead_n)

    # The chain left to the next program, from its start: its accumulator goes to this program's carry slot.
    acc = gl.zeros((block_m, block_n), gl.float32, acc_layout)
    for q in range(lead):
        acc = _step(x_stages, w_stages, filled, acc, q, q > 0)
        ahead_tile, ahead_m, ahead_n = _copy_ahead(
            x_desc, w_desc, x_stages, w_stages, filled, q, n, lead_lo, lead, carried_hi, whole, lo, ahead_tile,
            ahead_m, ahead_n, M, STEPS, N_TILES, GROUP_M,
        )  # fmt: skip
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if lead > 0:
        gl.store(carry_ptr + pid * block_m * block_n + carry_offsets, acc)
        gl.thread_barrier()
        gl.atomic_xchg(flags_ptr + pid, 1, sem="release", scope="gpu")

    # Whole chains, each from zeros.
    for c in range(whole // STEPS):
        acc = gl.zeros((block_m, block_n), gl.float32, acc_layout)
        for k in range(STEPS):
            q = lead + c * STEPS + k
            acc = _step(x_stages, w_stages, filled, acc, q, k > 0)
            ahead_tile, ahead_m, ahead_n = _copy_ahead(
                x_desc, w_desc, x_stages, w_stages, filled, q, n, lead_lo, lead, carried_hi, whole, lo,
                ahead_tile, ahead_m, ahead_n, M, STEPS, N_TILES, GROUP_M,
            )  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        off_m, off_n = mg._tile_origin(
            (carried_hi + c * STEPS) // STEPS, M, block_m, block_n, N_TILES, GROUP_M
        )
        mg._store_tile(acc, out_desc, out_stage, off_m, off_n)

    # The chain the program before left unfinished, continued from its accumulator.
    carried = carried_hi - lo
    if carried > 0:
        ready = gl.atomic_add(flags_ptr + pid - 1, 0, sem="acquire", scope="gpu")
        while ready == 0:
            ready = gl.atomic_add(flags_ptr + pid - 1, 0, sem="acquire", scope="gpu")
        acc = gl.load(carry_ptr + (pid - 1) * block_m * block_n + carry_offsets, cache_modifier=".cg")
        gl.atomic_xchg(flags_ptr + pid - 1, 0, sem="relaxed", scope="gpu")
        for j in range(carried):
            q = lead + whole + j
            acc = _step(x_stages, w_stages, filled, acc, q, True)
            ahead_tile, ahead_m, ahead_n = _copy_ahead(
                x_desc, w_desc, x_stages, w_stages, filled, q, n, lead_lo, lead, carried_hi, whole, lo,
                ahead_tile, ahead_m, ahead_n, M, STEPS, N_TILES, GROUP_M,
            )  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        off_m, off_n = mg._tile_origin(lo // STEPS, M, block_m, block_n, N_TILES, GROUP_M)
        mg._store_tile(acc, out_desc, out_stage, off_m, off_n)
    tma.store_wait(0)


def streamed(x: torch.Tensor, w: torch.Tensor, tile: tuple[int, int, int, int, int]) -> torch.Tensor:
    (m, k), n = x.shape, w.shape[0]
    block_m, block_n, block_k, warps, depth = tile
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    steps = k // block_k
    n_tiles = -(-n // block_n)
    units = -(-m // block_m) * n_tiles * steps
    run = max(-(-units // mm._multiprocessors(x.device)), steps)  # never shorter than a chain
    programs = -(-units // run)
    carry = torch.empty((programs, block_m * block_n), device=x.device, dtype=torch.float32)
    flags = torch.zeros(programs, device=x.device, dtype=torch.int32)
    _streamed_kernel[(programs,)](
        mg._descriptor(x, [block_m, block_k]), mg._descriptor(w, [block_n, block_k]),
        mg._descriptor(out, [block_m, block_n]), carry, flags, m, run,
        STEPS=steps, DEPTH=depth, N_TILES=n_tiles, GROUP_M=16, PDL=True, num_warps=warps, launch_pdl=True,
    )  # fmt: skip
    return out


SHAPES = {"o_proj": (2048, 2048), "qkv": (4096, 2048), "gate_up": (12288, 2048), "lm_head": (151936, 2048)}
SIZES = [136, 200, 264, 272, 288, 336, 400, 512]
TILES = [
    (128, 128, 64, 8, 5),
    (64, 128, 64, 4, 6),
    (64, 128, 128, 4, 4),
    (64, 64, 64, 4, 8),
    (64, 256, 64, 4, 4),
]


def main() -> None:
    report: dict[str, Any] = {}
    t0 = time.time()
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        x = torch.randn(max(SIZES), k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        copies = weight_copies(w)
        for m in SIZES:
            row: dict[str, Any] = {"cublas": time_rotating(lambda a, b: F.linear(a, b), x[:m], copies)}
            ref = mm.matmul(x[:m], w)
            row["plan"] = time_rotating(lambda a, b: mm.matmul(a, b), x[:m], copies)
            for tile in TILES:
                persistent = mp.MatmulTile(*tile, gluon="persistent")
                plan = mp.MatmulPlan(1, ((mp.LARGE_M, persistent),))
                try:
                    row[f"{tile} persistent"] = {
                        "us": time_rotating(
                            lambda a, b, p=plan, t=persistent: mm.matmul(a, b, p, t), x[:m], copies
                        )
                    }
                    same = bool(torch.equal(streamed(x[:m], w, tile), ref))
                    us = time_rotating(lambda a, b, t=tile: streamed(a, b, t), x[:m], copies)
                    row[f"{tile} streamed"] = {"us": us, "same_bits": same}
                except Exception as exc:
                    row[f"{tile} streamed"] = {"error": repr(exc)[:300]}
            timed = {key: v["us"] for key, v in row.items() if isinstance(v, dict) and "us" in v}
            best_streamed = min((v, key) for key, v in timed.items() if key.endswith("streamed"))
            best_persistent = min((v, key) for key, v in timed.items() if key.endswith("persistent"))
            wrong = [key for key, v in row.items() if isinstance(v, dict) and v.get("same_bits") is False]
            report[f"{name} M={m}"] = row
            print(
                f"[{time.time() - t0:6.1f}s] {name} {m}: cublas {row['cublas']:.1f} plan {row['plan']:.1f}"
                f" ({row['plan'] / row['cublas']:.2f}) persistent {best_persistent[0]:.1f} {best_persistent[1]}"
                f" streamed {best_streamed[0]:.1f} ({best_streamed[0] / row['cublas']:.2f}) {best_streamed[1]}"
                f" other bits {wrong}",
                flush=True,
            )
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)
        del copies, x, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
