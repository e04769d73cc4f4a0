"""Check and tune the Triton batch-invariant kernels on one GPU in one run.

1. The ceilings: device-to-device copy bandwidth and cuBLAS bf16 TFLOP/s at 8192^3, on random data.
2. For every candidate matmul configuration at every Qwen3-1.7B weight shape: bitwise invariance of every row over
   M = 1..512 (against one M = 512 product, and shifted windows), and time against cuBLAS at M in `TIMED_M`.
   The configuration with the smallest worst ratio is what `matmul.TUNED` should hold for that shape.
3. cuBLAS's own invariance at the same shapes, for the record.

Usage: python bench/gpu_kernels.py OUT.json [--quick] [--deep] [--shapes=qkv,down]. Prints a short table last.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch

from pinned_backend.kernels.triton.matmul import MatmulConfig, matmul, matmul_config

SHAPES = {
    "qkv": (4096, 2048),
    "gate_up": (12288, 2048),
    "o_proj": (2048, 2048),
    "down": (2048, 6144),
    "lm_head": (151936, 2048),
}
TIMED_M = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512]
PREFILL_M = [2048, 8192]  # timed for the record, outside the 1..512 target
ROTATE_BYTES = 200 << 20  # weight copies cycled per timing: four times the H200's 50 MiB L2


def candidates(n: int, k: int) -> list[MatmulConfig]:
    tiles = [
        (64, 32, 128),
        (64, 64, 64),
        (64, 64, 128),
        (64, 128, 64),
        (64, 128, 128),
        (64, 256, 64),
        (128, 64, 64),
        (128, 128, 64),
        (128, 256, 64),
    ]
    splits = [1] if n > 50000 else [1, 2] if n > 8192 else [1, 2, 4, 8] if k > 4096 else [1, 2, 4]
    out = []
    for bm, bn, bk in tiles:
        for s in splits:
            if k % (s * bk) or k // s < 256:
                continue
            stages = 3 if bm * bk + bn * bk >= 16384 else 4
            out.append(MatmulConfig(bm, bn, bk, s, num_warps=8 if bm == 128 else 4, num_stages=stages))
    base = matmul_config(n, k)
    return out if base in out else [base, *out]


def deep_candidates(n: int, k: int) -> list[MatmulConfig]:
    """Deeper software pipelines for the narrow tiles: more weight bytes in flight per multiprocessor, which is
    what a memory-bound small-M product is short of when N gives few tiles."""
    splits = [1, 2, 4, 8] if k > 4096 else [1, 2, 4]
    out = []
    for bm, bn, bk in [(64, 64, 64), (64, 128, 64), (64, 64, 128), (64, 128, 128)]:
        stage_bytes = (bm + bn) * bk * 2
        for stages in (5, 6, 8):
            if stages * stage_bytes > 200 * 1024:
                continue
            for s in splits:
                if k % (s * bk) == 0 and k // s >= 256:
                    out.append(MatmulConfig(bm, bn, bk, s, num_warps=4, num_stages=stages))
    base = matmul_config(n, k)
    return out if base in out else [base, *out]


def bench_ms(fn) -> float:  # type: ignore[no-untyped-def]
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))


def weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """Copies of `w` that together far exceed L2, so that each timed call reads its weight from memory, as
    consecutive layers of a decode step do."""
    n = max(2, min(32, -(-ROTATE_BYTES // (w.numel() * w.element_size()))))
    return [w.clone() for _ in range(n)]


def time_rotating(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> float:  # type: ignore[no-untyped-def]
    """Microseconds per `fn(x, w)`, w cycling through `weights`, all calls captured in one CUDA graph so that
    launch gaps stay out (a decode step runs as a graph too); the median of five replays."""
    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    del graph
    return sorted(times)[2]


def ceilings() -> dict[str, float]:
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b)
    moved = 2 * src.numel() * src.element_size()  # read once, written once
    return {"copy_TBps": moved / ms / 1e9, "cublas_8192_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def invariance_failures(fn, x: torch.Tensor, w: torch.Tensor, ms: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    full = fn(x[:512], w)
    bad = [m for m in ms if not torch.equal(fn(x[:m], w), full[:m])]
    for j in (1, 5, 64, 77):
        if not torch.equal(fn(x[j : j + 512], w)[: 512 - j], full[j:]):
            bad.append(-j)
    return bad


def main() -> None:
    out_path = sys.argv[1]
    quick = "--quick" in sys.argv
    deep = "--deep" in sys.argv
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--shapes=")), list(SHAPES))
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    import triton

    report: dict[str, object] = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "ceilings": ceilings(),
        "shapes": {},
    }
    print(json.dumps(report["ceilings"]), flush=True)
    all_m = list(range(1, 513)) if not quick else [1, 2, 3, 64, 65, 200, 512]
    summary = []
    for name, (n, k) in SHAPES.items():
        if name not in only:
            continue
        x = torch.randn(max(PREFILL_M), k, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
        copies = weight_copies(w)
        ref = x[:64].double() @ w.double().T
        timed = TIMED_M + PREFILL_M
        cublas_us = {m: time_rotating(lambda a, b: a @ b.T, x[:m], copies) for m in timed}
        cublas_bad = invariance_failures(lambda a, b: a @ b.T, x, w, all_m)
        rows = []
        for cfg in deep_candidates(n, k) if deep else candidates(n, k):
            t0 = time.time()
            try:
                out = matmul(x[:64], w, cfg)
                err = float((out.double() - ref).norm() / ref.norm())
                bad = invariance_failures(lambda a, b, c=cfg: matmul(a, b, c), x, w, all_m)
                t = {m: time_rotating(lambda a, b, c=cfg: matmul(a, b, c), x[:m], copies) for m in timed}
            except Exception as exc:  # a configuration that does not fit is a result, not a crash
                rows.append({"config": cfg.__dict__, "error": repr(exc)[:300]})
                continue
            ratios = {m: t[m] / cublas_us[m] for m in timed}
            rows.append(
                {
                    "config": cfg.__dict__,
                    "rel_err": err,
                    "invariance_failures": bad,
                    "us": t,
                    "ratio_to_cublas": ratios,
                    "worst_ratio": max(ratios[m] for m in TIMED_M),
                    "geomean_ratio": math.exp(sum(math.log(ratios[m]) for m in TIMED_M) / len(TIMED_M)),
                    "seconds": time.time() - t0,
                }
            )
            print(name, cfg, f"worst {rows[-1]['worst_ratio']:.2f}", f"bad {len(bad)}", flush=True)
        ok = [r for r in rows if "error" not in r and not r["invariance_failures"]]
        best = min(ok, key=lambda r: (r["worst_ratio"], r["geomean_ratio"])) if ok else None
        report["shapes"][name] = {  # type: ignore[index]
            "n": n,
            "k": k,
            "cublas_us": cublas_us,
            "cublas_invariance_failures": cublas_bad,
            "candidates": rows,
            "best": best,
        }
        if best:
            summary.append(
                (name, n, k, best["config"], best["worst_ratio"], best["geomean_ratio"], len(cublas_bad))
            )
        del x, w, copies
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    print(
        "\nshape     N       K     best config                                   worst  geomean  cublas-variant-M"
    )
    for name, n, k, cfg, worst, gm, cb in summary:
        c = f"{cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} s{cfg['split_k']} w{cfg['num_warps']} st{cfg['num_stages']}"
        print(f"{name:8s} {n:7d} {k:5d}   {c:44s} {worst:5.2f}  {gm:5.2f}    {cb}")


if __name__ == "__main__":
    main()
