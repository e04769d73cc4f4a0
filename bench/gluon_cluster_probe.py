"""Does sharing x's rows by multicast within a cluster win the down projection's worst sizes? (Triton 3.7 or later.)

cuBLAS's blocks at the down projection's M = 248..312 (bench/results/h200.md) run in clusters of 2 and 4 that copy
x's rows from L2 once and multicast them to every block of the cluster. Triton 3.7's Gluon issues that copy on
Hopper for a shared-memory layout that a cluster's CTAs all hold (`multicast=True`), but its barrier arrivals stay
within a CTA: one CTA cannot tell another that it has read a stage. So here the cluster barrier releases stages:
every G steps of K each CTA arrives, and G steps later waits for that phase before refilling the stages of the
group before, DEPTH - 2G or more steps ahead. Programs are clusters of C CTAs along N, each with a 64 x 64 tile,
one warpgroup issuing both copies and `wgmma` steps; K whole in SLICES chains added in slice order, as the
served 64 x 64 tile (`_specialized_kernel`) sums, so the bits must be the plan's.

Usage: python bench/gluon_cluster_probe.py OUT.json. Checks every configuration's bits against the committed plan
at M = 129..512 (every 7th), then times them at M = 192, 248, 256 and 312 against the plan and cuBLAS, all in turn.
Runs 80 and 81 ran its kernel, timing each function back to back (`h200_run80_cluster_probe.json`,
`h200_run81_cluster_probe.json`); it was not kept.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from typing import Any

import torch
from gpu_kernels import time_interleaved, weight_copies
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    cluster,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

mm = importlib.import_module("pinned_backend.kernels.triton.matmul")
mp = importlib.import_module("pinned_backend.kernels.triton.matmul_plans")

BLOCK = 64  # rows of x, weight rows a CTA, and K a step
# (CTAs a cluster, stages, steps between cluster barriers, relaxed arrivals)
CONFIGS = [(2, 8, 1, False), (2, 8, 1, True), (2, 8, 2, True), (2, 10, 2, True), (2, 10, 4, True), (2, 12, 4, True),
           (2, 12, 4, False), (4, 12, 4, True)]  # fmt: skip
TIMED_M = [192, 248, 256, 312]


@gluon.constexpr_function
def _cta_bases(ctas: int, unit: list[int]) -> list[list[int]]:
    """A cluster layout's bases, in CTA tiles: CTA bit i moves `unit` times 2**i tiles (a zero unit broadcasts)."""
    return [[u << i for u in unit] for i in range(int(math.log2(ctas)))]


@gluon.constexpr_function
def _acc_layout(ctas: int) -> Any:
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16], cga_layout=_cta_bases(ctas, [0, 1])
    )


@gluon.constexpr_function
def _barrier_layout(ctas: int) -> Any:
    return mbarrier.MBarrierLayout(_cta_bases(ctas, [1]))


@gluon.jit(do_not_specialize=["M"])
def _clustered_kernel(
    x_desc, w_desc, out_desc, M,
    SLICES: gl.constexpr, STEPS: gl.constexpr, DEPTH: gl.constexpr, C: gl.constexpr, G: gl.constexpr,
    RELAXED: gl.constexpr,
):  # fmt: skip
    block_m: gl.constexpr = x_desc.block_type.shape[0]
    block_k: gl.constexpr = x_desc.block_type.shape[1]
    block_n: gl.constexpr = w_desc.block_type.shape[0]
    per_slice: gl.constexpr = STEPS // SLICES
    tile = gl.program_id(0)
    num_m = gl.cdiv(M, block_m)
    off_m = gl.minimum((tile % num_m) * block_m, gl.maximum(M - block_m, 0))
    off_n = (tile // num_m) * block_n

    x_stages = gl.allocate_shared_memory(x_desc.dtype, [DEPTH, block_m, block_k], x_desc.layout)
    w_stages = gl.allocate_shared_memory(w_desc.dtype, [DEPTH, block_n, block_k], w_desc.layout)
    filled = gl.allocate_shared_memory(gl.int64, [DEPTH, C], _barrier_layout(C))
    out_stage = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    for b in gl.static_range(DEPTH):
        mbarrier.init(filled.index(b), count=1)
    mbarrier.sync_cluster_init()

    # Each CTA's stage: x's rows, multicast by CTA 0, and its own weight rows.
    stage_bytes: gl.constexpr = (block_m + block_n // C) * block_k * 2
    for p in gl.static_range(DEPTH):
        mbarrier.expect(filled.index(p), stage_bytes)
        tma.async_copy_global_to_shared(
            x_desc, [off_m, p * block_k], filled.index(p), x_stages.index(p), multicast=True
        )
        tma.async_copy_global_to_shared(w_desc, [off_n, p * block_k], filled.index(p), w_stages.index(p))

    acc_layout: gl.constexpr = _acc_layout(C)
    total = gl.zeros((block_m, block_n), gl.float32, acc_layout)
    for s in gl.static_range(SLICES):
        acc = gl.zeros((block_m, block_n), gl.float32, acc_layout)
        for j in range(per_slice):
            i = s * per_slice + j
            stage = i % DEPTH
            mbarrier.wait(filled.index(stage), (i // DEPTH) & 1)
            acc = warpgroup_mma(
                x_stages.index(stage),
                w_stages.index(stage).permute((1, 0)),
                acc,
                use_acc=j > 0,
                is_async=True,
            )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # At a group boundary every step before i is done in this CTA. Every CTA's group before the last is
            # done (the phase arrived at on the boundary before): its stages take the steps DEPTH on.
            if i % G == 0:
                group = i // G
                if group >= 2:
                    cluster.wait()
                    for r in gl.static_range(G):
                        refill = (group - 2) * G + r + DEPTH
                        if refill < STEPS:
                            rs = refill % DEPTH
                            mbarrier.expect(filled.index(rs), stage_bytes)
                            tma.async_copy_global_to_shared(
                                x_desc, [off_m, refill * block_k], filled.index(rs), x_stages.index(rs),
                                multicast=True,
                            )  # fmt: skip
                            tma.async_copy_global_to_shared(
                                w_desc, [off_n, refill * block_k], filled.index(rs), w_stages.index(rs)
                            )
                if group >= 1:
                    cluster.arrive(relaxed=RELAXED)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        total = acc if s == 0 else total + acc
    # The last arrival's phase, so that no CTA leaves while another may still wait on it.
    cluster.wait()
    out_stage.store(total.to(out_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_stage)
    tma.store_wait(0)


def clustered(
    x: torch.Tensor, w: torch.Tensor, ctas: int, slices: int, depth: int, every: int, relaxed: bool
) -> Any:
    m, k = x.shape
    n = w.shape[0]
    block_n = BLOCK * ctas
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)

    def shared(unit: list[int]) -> Any:
        return gl.NVMMASharedLayout(128, 16, 2, cga_layout=_cta_bases(ctas, unit))

    x_desc = TensorDescriptor.from_tensor(x, [BLOCK, BLOCK], shared([0, 0]))
    w_desc = TensorDescriptor.from_tensor(w, [block_n, BLOCK], shared([1, 0]))
    out_desc = TensorDescriptor.from_tensor(out, [BLOCK, block_n], shared([0, 1]))
    grid = (-(-m // BLOCK) * (n // block_n),)
    _clustered_kernel[grid](
        x_desc, w_desc, out_desc, m, SLICES=slices, STEPS=k // BLOCK, DEPTH=depth, C=ctas, G=every,
        RELAXED=relaxed, num_warps=4, num_ctas=ctas,
    )  # fmt: skip
    return out


def main() -> None:
    n, k = 2048, 6144
    plan = mp.TUNED[(n, k)]
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1024, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    copies = weight_copies(w)
    full = mm.matmul(x[:512], w, plan)
    report: dict[str, Any] = {"configs": [], "times": []}
    usable = []
    for config in CONFIGS:
        ctas, depth, every, relaxed = config
        start = time.time()
        try:
            bad = [
                m
                for m in range(129, 513, 7)
                if not torch.equal(clustered(x[:m], w, ctas, plan.split_k, depth, every, relaxed), full[:m])
            ]
        except Exception as e:  # a configuration that does not compile or launch is reported, not fatal
            print("config", config, "failed:", type(e).__name__, str(e)[:400], flush=True)
            continue
        usable.append(config)
        report["configs"].append({"config": config, "bad_m": bad, "seconds": time.time() - start})
        print("config", config, "mismatched M:", bad, flush=True)
    for m in TIMED_M:
        fns = [lambda a, b: a @ b.T, lambda a, b: mm.matmul(a, b, plan)]
        fns += [lambda a, b, c=c: clustered(a, b, c[0], plan.split_k, c[1], c[2], c[3]) for c in usable]
        us = time_interleaved(fns, x[:m], copies)
        row = {
            "m": m,
            "cublas": us[0],
            "plan": us[1],
            **{str(c): t for c, t in zip(usable, us[2:], strict=True)},
        }
        report["times"].append(row)
        print(m, {key: round(v, 1) for key, v in row.items()}, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
