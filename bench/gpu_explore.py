"""The experiments behind the kernel choices of bench/results/h200.md, one part per question, in one run.

- decode: a decode step per kernel mode and KV split size, with and without programmatic dependent launch;
- prefill: prefill throughput with the plans as tuned and with TMA tiles from M = 129 or 513 on;
- large, mid: tiles with and without TMA at prefill sizes and at M = 144..512, bits compared with the plan's;
- pdlmm: chains of one matmul in a graph, with and without dependent launch;
- host, hostprof: host microseconds of one eager call, and where they go;
- gluon: the Gluon tiles (matmul_gluon.py), each kernel and tile alone, against the plan and cuBLAS at
  M = 129..512 and a prefill size, bits compared with the plan's.

Usage: python bench/gpu_explore.py OUT.json [decode,prefill,large,mid,pdlmm,host,hostprof]. Writes JSON as it goes.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from gpu_kernels import time_rotating, weight_copies
from gpu_price import (
    DEVICE,
    PAGE,
    copy_bandwidth,
    decode_rate,
    prefill_rate,
    qwen3_1_7b,
    random_weights,
    weight_bytes,
)

from pinned_backend.kernels.triton import CublasKernels, TritonKernels
from pinned_backend.kernels.triton.dependent_launch import force_dependent_launch
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.model import Transformer

mm = importlib.import_module("pinned_backend.kernels.triton.matmul")
mp = importlib.import_module("pinned_backend.kernels.triton.matmul_plans")

OUT = sys.argv[1]
PARTS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["decode", "mid", "large", "prefill"]
report: dict[str, Any] = {}
T0 = time.time()


def save() -> None:
    with open(OUT, "w") as f:
        json.dump(report, f, indent=1)


def log(*a: Any) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


SHAPES = {
    "qkv": (4096, 2048),
    "o_proj": (2048, 2048),
    "gate_up": (12288, 2048),
    "down": (2048, 6144),
    "lm_head": (151936, 2048),
}


def with_tma(plan: mp.MatmulPlan, min_m: int) -> mp.MatmulPlan:
    tiles = tuple(
        (
            mx,
            mp.MatmulTile(**{**t.__dict__, "tma": True})
            if mx >= min_m and not (t.split_programs or t.swap)
            else t,
        )
        for mx, t in plan.tiles
    )
    return mp.MatmulPlan(plan.split_k, tiles)


def part_decode(config: Any, weights: dict[str, torch.Tensor]) -> None:
    kernels = {
        "default": CublasKernels(),
        "inv256": TritonKernels(kv_split_size=256),
        "inv128": TritonKernels(kv_split_size=128),
        "inv64": TritonKernels(kv_split_size=64),
    }
    models = {
        n: Transformer(config, dict(weights), k, torch.device(DEVICE), torch.bfloat16)
        for n, k in kernels.items()
    }
    cache = PagedKVCache(config, 128 * 37 + 16, PAGE, torch.device(DEVICE), torch.bfloat16)
    res: dict[str, Any] = {"floor_ms": weight_bytes(models["default"]) / copy_bandwidth() / 1e9}
    report["decode"] = res
    # (kernels, dependent launch, batch sizes)
    variants = [
        ("default", True, [1, 8, 32, 128]),
        ("inv256", True, [1, 8, 32, 128]),
        ("inv128", True, [1, 8, 32, 128]),
        ("inv64", True, [1, 8, 32, 128]),
        ("inv64", False, [1]),
    ]
    for name in ("inv256", "inv128", "inv64"):
        for b in (1, 8):
            r = prefill_rate(models[name], cache, b)
            res[f"prefill {name} b={b}"] = r
            log("prefill", name, b, f"{r['tokens_per_s']:.0f} tok/s")
    for name, pdl, batches in variants:
        force_dependent_launch(pdl)
        for b in batches:
            key = f"{name} pdl={int(pdl)} b={b}"
            try:
                r = decode_rate(models[name], cache, b)
                res[key] = r
                log("decode", key, f"{r['step_ms']:.3f} ms", f"x{r['step_ms'] / res['floor_ms']:.2f}")
            except Exception:
                res[key] = {"error": traceback.format_exc()[-600:]}
                log("decode", key, "ERROR", traceback.format_exc()[-300:])
            save()
    force_dependent_launch(None)
    del models, cache
    torch.cuda.empty_cache()


def part_matmul(ms: list[int], tiles: list[tuple[int, ...]], label: str) -> None:
    res: dict[str, Any] = {}
    report[label] = res
    for name, (n, k) in SHAPES.items():
        ms_here = [m for m in ms if m <= 2048] if name == "lm_head" and max(ms) > 2048 else ms
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        x = torch.randn(max(ms_here), k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        copies = weight_copies(w)
        plan = mp.matmul_plan(n, k, (9, 0))
        splits = [plan.split_k] + ([1] if name == "down" else [])
        for m in ms_here:
            row: dict[str, Any] = {"cublas": time_rotating(lambda a, b: F.linear(a, b), x[:m], copies)}
            ref = mm.matmul(x[:m], w)
            row["plan"] = time_rotating(lambda a, b: mm.matmul(a, b), x[:m], copies)
            row["plan_tile"] = plan.tile_for(m).__dict__
            for split in splits:
                for t in tiles:
                    for tma in (False, True):
                        tile = mp.MatmulTile(*t, tma=tma)
                        if (tile.block_m + tile.block_n) * tile.block_k * 2 * tile.num_stages > 220 * 1024:
                            continue
                        p = mp.MatmulPlan(split, ((mp.LARGE_M, tile),))
                        key = f"s{split} {t} tma={int(tma)}"
                        try:
                            out = mm.matmul(x[:m], w, p, tile)
                            same = bool(torch.equal(out, ref)) if split == plan.split_k else None
                            us = time_rotating(
                                lambda a, b, p=p, tile=tile: mm.matmul(a, b, p, tile), x[:m], copies
                            )
                            row[key] = {"us": us, "same_bits": same}
                        except Exception as exc:
                            row[key] = {"error": repr(exc)[:200]}
            best = min(
                (
                    (kk, v["us"])
                    for kk, v in row.items()
                    if isinstance(v, dict)
                    and "us" in v
                    and v.get("same_bits") is not False
                    and kk.startswith(f"s{plan.split_k}")
                ),
                key=lambda kv: kv[1],
                default=("none", float("nan")),
            )
            row["best"] = best
            res[f"{name} M={m}"] = row
            log(
                label,
                name,
                m,
                f"cublas {row['cublas']:.1f} plan {row['plan']:.1f} best {best[0]} {best[1]:.1f}",
                f"ratio plan {row['plan'] / row['cublas']:.2f} best {best[1] / row['cublas']:.2f}",
            )
            save()
        del copies, x, w
        torch.cuda.empty_cache()


def part_gluon(ms: list[int], tiles: list[tuple[int, int, int, int, int]]) -> None:
    res: dict[str, Any] = {}
    report["gluon"] = res
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        x = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        copies = weight_copies(w)
        split = mp.matmul_plan(n, k, (9, 0)).split_k
        for m in ms:
            row: dict[str, Any] = {"cublas": time_rotating(lambda a, b: F.linear(a, b), x[:m], copies)}
            ref = mm.matmul(x[:m], w)
            row["plan"] = time_rotating(lambda a, b: mm.matmul(a, b), x[:m], copies)
            for tile in tiles:
                for kernel in ("specialized", "pipelined", "persistent"):
                    gluon_tile = mp.MatmulTile(*tile, gluon=kernel)
                    plan = mp.MatmulPlan(split, ((mp.LARGE_M, gluon_tile),))

                    def run(
                        a: torch.Tensor,
                        b: torch.Tensor,
                        p: mp.MatmulPlan = plan,
                        t: mp.MatmulTile = gluon_tile,
                    ) -> torch.Tensor:
                        return mm.matmul(a, b, p, t)

                    key = f"{tile} {kernel}"
                    try:
                        same = bool(torch.equal(run(x[:m], w), ref))
                        row[key] = {"us": time_rotating(run, x[:m], copies), "same_bits": same}
                    except Exception as exc:
                        row[key] = {"error": repr(exc)[:300]}
            timed = [(kk, v["us"]) for kk, v in row.items() if isinstance(v, dict) and "us" in v]
            best = min(timed, key=lambda kv: kv[1], default=("none", float("nan")))
            row["best"] = best
            res[f"{name} M={m}"] = row
            wrong = [kk for kk, v in row.items() if isinstance(v, dict) and v.get("same_bits") is False]
            errors = [kk for kk, v in row.items() if isinstance(v, dict) and "error" in v]
            log(
                "gluon", name, m, f"cublas {row['cublas']:.1f} plan {row['plan']:.1f} best {best[0]} {best[1]:.1f}",
                f"ratio plan {row['plan'] / row['cublas']:.2f} best {best[1] / row['cublas']:.2f}",
                f"other bits {wrong} errors {errors}",
            )  # fmt: skip
            save()
        del copies, x, w
        torch.cuda.empty_cache()


def part_pdl_matmul() -> None:
    """Chains of one matmul in a graph with and without dependent launch: what overlap buys a product."""
    res: dict[str, Any] = {}
    report["pdl_matmul"] = res
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        copies = weight_copies(w)
        for m in (1, 64, 128, 256, 512):
            row = {"cublas": time_rotating(lambda a, b: F.linear(a, b), x[:m], copies)}
            for pdl in (False, True):
                force_dependent_launch(pdl)
                row[f"pdl={int(pdl)}"] = time_rotating(lambda a, b: mm.matmul(a, b), x[:m], copies)
            res[f"{name} M={m}"] = row
            log("pdl_matmul", name, m, json.dumps({kk: round(v, 1) for kk, v in row.items()}))
        force_dependent_launch(None)
        save()
        del copies


def part_prefill(config: Any, weights: dict[str, torch.Tensor]) -> None:
    res: dict[str, Any] = {}
    report["prefill"] = res
    models = {
        "default": Transformer(config, dict(weights), CublasKernels(), torch.device(DEVICE), torch.bfloat16),
        "inv": Transformer(config, dict(weights), TritonKernels(), torch.device(DEVICE), torch.bfloat16),
    }
    cache = PagedKVCache(config, 128 * 33 + 16, PAGE, torch.device(DEVICE), torch.bfloat16)
    original = dict(mp.TUNED)
    for variant in ("plan", "tma>512", "tma>128"):
        mp.TUNED.clear()
        mp.TUNED.update(original)
        if variant != "plan":
            lo = 513 if variant == "tma>512" else 129
            for key, plan in original.items():
                mp.TUNED[key] = with_tma(plan, lo)
        mp.matmul_plan.cache_clear()
        for b in (1, 8, 32, 128):
            for name in ["default", "inv"] if variant == "plan" else ["inv"]:
                try:
                    r = prefill_rate(models[name], cache, b)
                    res[f"{name} {variant} b={b}"] = r
                    log("prefill", name, variant, b, f"{r['tokens_per_s']:.0f} tok/s")
                except Exception:
                    res[f"{name} {variant} b={b}"] = {"error": traceback.format_exc()[-600:]}
                    log("prefill", name, variant, b, "ERROR", traceback.format_exc()[-300:])
            save()
    mp.TUNED.clear()
    mp.TUNED.update(original)
    mp.matmul_plan.cache_clear()


def part_host() -> None:
    """Host microseconds per eager call, with the GPU idle enough that the host is the bottleneck."""
    res: dict[str, Any] = {}
    report["host"] = res
    n, k = 2048, 6144
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(8, 2 * 6144, device="cuda", dtype=torch.bfloat16)
    from pinned_backend.kernels.triton import silu_mul

    cases = {
        "F.linear M=1": lambda: F.linear(x[:1], w),
        "matmul M=1": lambda: mm.matmul(x[:1], w),
        "matmul M=512": lambda: mm.matmul(x[:512], w),
        "matmul M=512 one program per tile": lambda: mm.matmul(
            x[:512], w, tile=mp.MatmulTile(128, 128, 64, 8, 3)
        ),
        "matmul M=512 a slice per program": lambda: mm.matmul(
            x[:512], w, tile=mp.MatmulTile(64, 128, 64, 4, 6, split_programs=True)
        ),
        "matmul M=512 tma": lambda: mm.matmul(x[:512], w, tile=mp.MatmulTile(128, 128, 64, 8, 3, tma=True)),
        "silu_mul": lambda: silu_mul(g),
        "torch.empty": lambda: torch.empty((512, n), device="cuda", dtype=torch.bfloat16),
    }
    from pinned_backend.kernels.triton.reused_launch import reuse_launches

    def through_triton(fn: Callable[[], Any]) -> Callable[[], Any]:
        def launch() -> Any:
            reuse_launches(False)
            try:
                return fn()
            finally:
                reuse_launches(True)

        return launch

    for name in [c for c in cases if c.startswith("matmul")]:
        cases[f"{name}, Triton's own launch"] = through_triton(cases[name])
    # This host's times wander by tens of percent between moments: three rounds over every case, the least kept.
    for _ in range(3):
        for name, fn in cases.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(300):
                fn()
            host = (time.perf_counter() - t) / 300 * 1e6
            torch.cuda.synchronize()
            res[name] = min(host, res.get(name, host))
    for name, host in res.items():
        log("host", name, f"{host:.1f} us/call")
    save()


def part_host_profile() -> None:
    """Where the host time of one eager matmul call goes."""
    import cProfile
    import io
    import pstats

    w = torch.randn(2048, 6144, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 6144, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        mm.matmul(x, w)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        mm.matmul(x, w)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    report["host_profile"] = buf.getvalue()
    print(buf.getvalue()[:6000], flush=True)
    save()


def main() -> None:
    if "hostprof" in PARTS:
        part_host_profile()
    if "host" in PARTS:
        part_host()
    config = qwen3_1_7b()
    weights = random_weights(config, seed=0)
    if "decode" in PARTS:
        part_decode(config, weights)
    if "pdlmm" in PARTS:
        part_pdl_matmul()
    if "prefill" in PARTS:
        part_prefill(config, weights)
    del weights
    torch.cuda.empty_cache()
    if "large" in PARTS:
        part_matmul(
            [2048, 8192],
            [
                (128, 128, 64, 8, 3),
                (128, 128, 64, 8, 4),
                (128, 256, 64, 8, 3),
                (128, 256, 64, 8, 4),
                (256, 128, 64, 8, 3),
                (64, 256, 64, 4, 4),
            ],
            "large",
        )
    if "mid" in PARTS:
        part_matmul(
            [144, 256, 288, 384, 512],
            [
                (64, 64, 64, 4, 6),
                (64, 128, 64, 4, 4),
                (64, 128, 64, 4, 6),
                (128, 64, 64, 8, 4),
                (128, 128, 64, 8, 3),
                (128, 128, 64, 8, 5),
                (64, 256, 64, 4, 4),
            ],
            "mid",
        )
    if "gluon" in PARTS:
        part_gluon(
            [136, 192, 256, 264, 288, 336, 384, 400, 448, 512, 2048],
            [
                (128, 128, 64, 8, 4),
                (128, 128, 64, 8, 5),
                (128, 128, 64, 8, 6),
                (128, 128, 128, 8, 3),
                (128, 256, 64, 8, 3),
                (64, 256, 64, 4, 4),
                (64, 128, 64, 4, 6),
                (64, 128, 128, 4, 4),
                (64, 64, 64, 4, 8),
            ],
        )
    log("done")


if __name__ == "__main__":
    main()
