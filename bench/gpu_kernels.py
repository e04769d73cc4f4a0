"""Check and tune the Triton batch-invariant matmul on one GPU in one run.

1. The ceilings: device-to-device copy bandwidth and cuBLAS bf16 TFLOP/s at 8192^3, on random data.
2. For every Qwen3-1.7B weight shape and every candidate reduction order (split of K), a set of candidate tiles:
   - each tile against float64;
   - each tile bit-identical to the group's first tile at M = 512, and every M = 1..512 and shifted row windows
     bit-identical to that product: the proof that tiles may follow M without changing a row's bits;
   - time against cuBLAS at each M in `TIMED_M` (and the prefill sizes `PREFILL_M`).
3. Per reduction order, the fastest proven tile at each timed M makes a plan (tiles by M range); the order whose
   plan has the smallest worst ratio over M = 1..512 wins. The winning plan is then run as `matmul` runs it,
   checked bitwise again over M = 1..512 and timed at M between the timed points, and printed as Python for
   `matmul_plans.TUNED`.
4. cuBLAS's own invariance at the same shapes, for the record.

Usage: python -m bench.gpu_kernels OUT.json [--shapes=qkv,down] [--splits=down:2+3] [--budget-s=SECONDS]
[--within=LOW:HIGH] [--candidates=committed+partitioned] [--write-tuned | --committed]. Prints a short table last;
`--splits` names the reduction orders to try for a shape in place of `SPLITS`'s; `--within` times and chooses tiles
at the timed M from LOW to HIGH only, the committed plans keeping theirs at the other M (and their reduction orders);
`--candidates` tries only the tile families named (`candidate_tiles` in matmul_candidates.py, beside this script,
which holds every family); `--write-tuned` also rewrites `matmul_plans.TUNED` with the winning plans of the shapes
swept; `--committed` sweeps nothing and runs step 3's checks and timings on the plans in `matmul_plans.TUNED`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.matmul_candidates import candidate_tiles, committed_plan
from pinned_backend.kernels.triton.matmul import matmul
from pinned_backend.kernels.triton.matmul_plans import MatmulPlan, MatmulTile

SHAPES = {
    "down": (2048, 6144),
    "o_proj": (2048, 2048),
    "qkv": (4096, 2048),
    "gate_up": (12288, 2048),
    "lm_head": (151936, 2048),
}
# Reduction orders tried per weight: the winners of run 30, which tried more. Two or four slices of K for the
# 2048-wide weights, and four for the down projection, lost at every M, also at M = 129..512 where their programs
# could fill the chip (1.1-5x slower than one slice: slices inside one program keep two accumulators and restart
# the pipeline; in programs of their own they add a partials round trip). The down projection keeps two slices:
# with K whole it lost more decode than it won prefill (bench/results/h200.md, run 16).
SPLITS = {"down": [2], "o_proj": [1], "qkv": [1], "gate_up": [1], "lm_head": [1]}
# Past M = 128 a tile's rows either fill its blocks or idle in the last one, so plans change tile often there; just
# past a multiple of 64 (136, 200, 264, ...) a 64-row tile's last block idles most, and a plan's range must hold there.
MID_M = [136, 144, 160, 176, 192, 200, 224, 240, 256, 264, 272, 288, 304, 320, 336, 352, 384, 400, 416, 448]
MID_M += [464, 480, 496, 512]
TIMED_M = [1, 8, 16, 32, 64, 96, 128, *MID_M]
# Sizes between the timed ones, checked on the final plan only: a few below 129, and above it every multiple of 8.
BETWEEN_M = [3, 24, 48, 80, 112] + [m for m in range(136, 513, 8) if m not in MID_M]
PREFILL_M = [2048, 8192]  # chooses the tile past 512; timed for the record, outside the 1..512 target
ROTATE_BYTES = 200 << 20  # weight copies cycled per timing: four times the H200's 50 MiB L2
LARGE_M = 1 << 62


# Tiles timed at the prefill sizes: those wide enough to be arithmetic-bound there.
PREFILL_TILE_MIN_AREA = 128 * 128


def weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """Copies of `w` that together far exceed L2, so that each timed call reads its weight from memory, as
    consecutive layers of a decode step do."""
    n = max(2, min(32, -(-ROTATE_BYTES // (w.numel() * w.element_size()))))
    return [w.clone() for _ in range(n)]


def time_rotating(fn: Callable[..., Any], x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds per `fn(x, w)`, w cycling through `weights`, all calls captured in one CUDA graph so that
    launch gaps stay out (a decode step runs as a graph too); the median of five replays."""
    return time_interleaved([fn], x, weights)[0]


def time_interleaved(
    fns: list[Callable[..., Any]], x: torch.Tensor, weights: list[torch.Tensor], replays: int = 5
) -> list[float]:
    """`time_rotating` for several functions at once, their replays taken in turn: each median then comes from the
    same stretch of the GPU's clocks, which drift by a few percent within a run (run 82, timed back to back: in the
    second of two checks gate_up's tile took 5% longer at M = 312 and cuBLAS 2%)."""
    graphs = []
    for fn in fns:
        for w in weights[:2]:
            fn(x, w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                fn(x, w)
        graph.replay()
        graphs.append(graph)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(replays):
        for graph, taken in zip(graphs, times, strict=True):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            taken.append(start.elapsed_time(end) * 1e3 / len(weights))
    del graphs
    return [sorted(taken)[len(taken) // 2] for taken in times]


def bench_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))


def ceilings() -> dict[str, float]:
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b)
    moved = 2 * src.numel() * src.element_size()  # read once, written once
    return {"copy_TBps": moved / ms / 1e9, "cublas_8192_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def mismatches(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, full: torch.Tensor) -> list[int]:
    """The M (and, negated, the row offsets) at which `fn` gives a row other bits than `full` = the M = 512
    reference product of x[:512]."""
    bad = [m for m in range(1, 513) if not torch.equal(fn(x[:m]), full[:m])]
    for j in (1, 5, 64, 77):
        if not torch.equal(fn(x[j : j + 512])[: 512 - j], full[j:]):
            bad.append(-j)
    return bad


def plan_from(
    rows: list[dict[str, Any]], split: int, sizes: list[int]
) -> tuple[MatmulPlan, dict[int, float]]:
    """The fastest tile at each timed M of `sizes`, as a plan of M ranges (a range ends at a timed M), and its
    times."""
    chosen: list[tuple[int, MatmulTile]] = []
    times: dict[int, float] = {}
    for m in sizes:
        # Tiles not timed at an M (narrow ones at the prefill sizes) have an infinite time.
        best = min(rows, key=lambda r: r["us"][m])
        tile = MatmulTile(**best["tile"])
        times[m] = best["us"][m]
        if chosen and chosen[-1][1] == tile:
            chosen[-1] = (m, tile)
        else:
            chosen.append((m, tile))
    chosen[-1] = (LARGE_M, chosen[-1][1])
    return MatmulPlan(split, tuple(chosen)), times


def plan_expression(plan: MatmulPlan) -> str:
    """`plan` as the Python that `matmul_plans.TUNED` holds."""
    tiles = []
    for max_m, t in plan.tiles:
        bound = "LARGE_M" if max_m == LARGE_M else str(max_m)
        flags = ("split_programs", "tma", "swap", "stream")
        extra = "".join(f", {flag}=True" for flag in flags if getattr(t, flag))
        extra += f", tail={t.tail}" if t.tail else ""
        extra += f", gluon={t.gluon!r}" if t.gluon else ""
        tiles.append(
            f"({bound}, _tile({t.block_m}, {t.block_n}, {t.block_k}, {t.num_warps}, {t.num_stages}{extra}))"
        )
    return f"MatmulPlan({plan.split_k}, ({', '.join(tiles)},))"


def plan_source(name: str, n: int, k: int, plan: MatmulPlan) -> str:
    return f"    ({n}, {k}): {plan_expression(plan)},  # {name}"


def tune_shape(
    name: str, n: int, k: int, deadline: float, within: tuple[int, int] = (1, LARGE_M), families: str = "all"
) -> dict[str, Any]:
    """Timing order matters on this chip: right after a large, arithmetic-bound product a small one runs up to 20%
    slower for a while. So every tile and cuBLAS are timed at M <= 512 first, in ascending M, and at the prefill
    sizes only after all of them; the final plan is timed with cuBLAS interleaved, M ascending. Tiles are timed
    and chosen at the timed M `within` (low, high) only; the committed plan keeps the other M."""
    timed = [m for m in TIMED_M if within[0] <= m <= within[1]]
    prefill = [m for m in PREFILL_M if within[0] <= m <= within[1]]
    x, w, copies = operands(n, k)
    ref = x[:64].double() @ w.double().T
    cublas = lambda a, b: a @ b.T  # noqa: E731
    cublas_us = {m: time_rotating(cublas, x[:m], copies) for m in timed}
    cublas_bad = mismatches(lambda a: a @ w.T, x, x[:512] @ w.T)
    groups: dict[int, dict[str, Any]] = {}
    for split in SPLITS[name]:
        rows: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        reference: torch.Tensor | None = None
        for tile in candidate_tiles(n, k, split, families):
            if time.time() > deadline:
                failed.append({"tile": tile.__dict__, "error": "skipped: time budget spent"})
                continue
            plan = MatmulPlan(split, ((LARGE_M, tile),))
            t0 = time.time()
            try:
                run = lambda a, b=w, p=plan, t=tile: matmul(a, b, p, t)  # noqa: E731
                out = run(x[:512])
                err = float((out[:64].double() - ref).norm() / ref.norm())
                if reference is None:
                    reference = out
                bad = mismatches(run, x, reference)
                us = {
                    m: time_rotating(lambda a, b, p=plan, t=tile: matmul(a, b, p, t), x[:m], copies)
                    for m in timed
                }
            except Exception as exc:  # a tile that does not fit is a result, not a crash
                failed.append({"tile": tile.__dict__, "error": repr(exc)[:300]})
                continue
            row = {
                "tile": tile.__dict__,
                "rel_err": err,
                "mismatches": bad,
                "us": us,
                "seconds": time.time() - t0,
            }
            (rows if not bad and err < 1e-2 else failed).append(row)
            print(name, split, tile, f"bad {len(bad)} err {err:.1e}", f"{time.time() - t0:.1f}s", flush=True)
        groups[split] = {"tiles": rows, "failed": failed}
    # cuBLAS again, after the tiles: the smaller of its two times, so that warm-up order never favours us.
    for m in timed:
        cublas_us[m] = min(cublas_us[m], time_rotating(cublas, x[:m], copies))
    for m in prefill:
        cublas_us[m] = time_rotating(cublas, x[:m], copies)
    for split, group in groups.items():
        for row in group["tiles"]:
            tile = MatmulTile(**row["tile"])
            single = MatmulPlan(split, ((LARGE_M, tile),))
            wide = tile.tma or bool(tile.gluon) or tile.block_m * tile.block_n >= PREFILL_TILE_MIN_AREA
            for m in prefill:
                row["us"][m] = (
                    time_rotating(lambda a, b, p=single, t=tile: matmul(a, b, p, t), x[:m], copies)
                    if wide
                    else math.inf
                )
    for split, group in groups.items():
        if not group["tiles"]:
            continue
        plan, times = plan_from(group["tiles"], split, timed + prefill)
        if within != (1, LARGE_M):
            plan = committed_plan(n, k).spliced(plan, *within)
        ratios = {m: times[m] / cublas_us[m] for m in timed + prefill}
        group.update(
            {
                "plan": plan_source(name, n, k, plan),
                "plan_ratio": ratios,
                "worst_ratio": max(ratios[m] for m in timed),
                "_plan": plan,
            }
        )
    done = [g for g in groups.values() if "_plan" in g]
    result: dict[str, Any] = {
        "n": n,
        "k": k,
        "cublas_us": dict(cublas_us),
        "cublas_mismatches": cublas_bad,
        "groups": {s: {key: v for key, v in g.items() if key != "_plan"} for s, g in groups.items()},
    }
    if not done:
        return result
    best = min(done, key=lambda g: (g["worst_ratio"], g["plan_ratio"].get(PREFILL_M[-1], 0.0)))
    result.update(check_plan(name, n, k, best["_plan"], x, w, copies))
    return result


def operands(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A shape's seeded activations (enough rows for the prefill sizes), its weight, and the weight's copies."""
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(max(PREFILL_M), k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    return x, w, weight_copies(w)


def check_plan(
    name: str, n: int, k: int, plan: MatmulPlan, x: torch.Tensor, w: torch.Tensor, copies: list[torch.Tensor]
) -> dict[str, Any]:
    """A plan as serving runs it: the tile picked by M, checked bitwise over M = 1..512 and past it, and timed at
    the timed M and those between, each M next to cuBLAS."""
    cublas = lambda a, b: a @ b.T  # noqa: E731
    serve = lambda a, b=w, p=plan: matmul(a, b, p)  # noqa: E731
    reference = serve(x[:512])
    final_bad = mismatches(serve, x, reference)
    # Past M = 512 the plan's own tiles (TMA ones among them) must give those rows the same bits too.
    final_bad += [m for m in PREFILL_M if not torch.equal(serve(x[:m])[:512], reference)]
    final_us: dict[int, float] = {}
    final_cublas: dict[int, float] = {}
    for m in sorted(TIMED_M + BETWEEN_M) + PREFILL_M:
        final_us[m], final_cublas[m] = time_interleaved(
            [lambda a, b, p=plan: matmul(a, b, p), cublas], x[:m], copies
        )
    final_ratio = {m: final_us[m] / final_cublas[m] for m in final_us}
    return {
        "plan": plan_source(name, n, k, plan),
        "plan_mismatches": final_bad,
        "plan_us": final_us,
        "plan_cublas_us": final_cublas,
        "plan_ratio": final_ratio,
        "worst_ratio_1_512": max(r for m, r in final_ratio.items() if m <= 512),
    }


def provable(result: dict[str, Any]) -> bool:
    """Whether a shape's winning plan may go into `TUNED`: its tiles agreed bit for bit at every M, and the sweep
    timed every candidate (a sweep cut short by its budget may have missed the best tiles)."""
    if "plan" not in result or result["plan_mismatches"]:
        return False
    failed = [t for g in result["groups"].values() for t in g["failed"]]
    return not any("time budget" in str(t.get("error", "")) or t.get("mismatches") for t in failed)


def write_tuned(plans: dict[tuple[int, int], str]) -> None:
    """Replace the entries of `matmul_plans.TUNED` for the swept shapes with their new plans; other entries stay."""
    plans_module = importlib.import_module("pinned_backend.kernels.triton.matmul_plans")
    path = Path(plans_module.__file__)
    source = path.read_text()
    head = "TUNED: dict[tuple[int, int], MatmulPlan] = {\n"
    start = source.index(head) + len(head)
    end = source.index("\n}\n", start)
    kept = [
        f"    {shape}: {plan_expression(plan)},"
        for shape, plan in plans_module.TUNED.items()
        if shape not in plans
    ]
    body = "\n".join([*kept, *plans.values()])
    path.write_text(source[:start] + body + source[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="where to write the JSON report")
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help="the weights to sweep, of " + ", ".join(SHAPES)
    )
    parser.add_argument(
        "--splits", default="", help="reduction orders to try in place of SPLITS's: down:2+3,o_proj:1"
    )
    parser.add_argument("--budget-s", type=float, default=1e9, help="time for the whole sweep")
    parser.add_argument("--candidates", default="all", help="tile families: all, or committed+partitioned")
    parser.add_argument("--within", default="", help="LOW:HIGH: choose tiles at these M only")
    parser.add_argument(
        "--write-tuned", action="store_true", help="rewrite matmul_plans.TUNED's swept shapes"
    )
    parser.add_argument("--committed", action="store_true", help="sweep nothing: check the committed plans")
    args = parser.parse_args()
    out_path, only, budget, families = args.out, args.shapes.split(","), args.budget_s, args.candidates
    for entry in filter(None, args.splits.split(",")):
        name, orders = entry.split(":")
        SPLITS[name] = [int(order) for order in orders.split("+")]
    low, _, high = args.within.partition(":")
    within = (int(low), int(high)) if low else (1, LARGE_M)
    if low:
        # The committed plan keeps the M outside the range, so tiles within it must reduce in its order.
        for name, (n, k) in SHAPES.items():
            SPLITS[name] = [committed_plan(n, k).split_k]
    start = time.time()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    import triton

    report: dict[str, Any] = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "ceilings": ceilings(),
        "shapes": {},
    }
    print(json.dumps(report["ceilings"]), flush=True)
    names = [s for s in SHAPES if s in only]
    # A shape's expected sweep time: its candidate tiles, weighted by K, since a tile's checks and timings take
    # longer the longer its K chains (the down projection's, K = 6144, took 1.2 to 1.7 s a tile in runs 45 and 46,
    # the others' 0.4 to 1.2 s; by tile count alone, run 46's share for it ran out 21 tiles short).
    cost = {
        name: SHAPES[name][1]
        * sum(len(candidate_tiles(*SHAPES[name], split, families)) for split in SPLITS[name])
        for name in names
    }
    for i, name in enumerate(names):
        n, k = SHAPES[name]
        if args.committed:
            plan = importlib.import_module("pinned_backend.kernels.triton.matmul_plans").TUNED[(n, k)]
            report["shapes"][name] = {"n": n, "k": k, **check_plan(name, n, k, plan, *operands(n, k))}
            with open(out_path, "w") as f:
                json.dump(report, f, indent=1)
            continue
        # Each shape gets a share of what is left of the budget in proportion to its cost; what it leaves unused
        # goes to the shapes after it.
        share = cost[name] / sum(cost[later] for later in names[i:])
        deadline = time.time() + (start + budget - time.time()) * share
        report["shapes"][name] = tune_shape(name, n, k, deadline, within, families)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    print(
        "\nshape     N       K    worst ratio 1..512 (M at worst)   above 1.25 at 129..512   mismatches"
        "  cuBLAS-variant"
    )
    for name, r in report["shapes"].items():
        if "plan" not in r:
            print(f"{name:8s} no proven tile")
            continue
        worst_m = max((m for m in r["plan_ratio"] if m <= 512), key=lambda m: r["plan_ratio"][m])
        mid = [ratio for m, ratio in r["plan_ratio"].items() if 128 < m <= 512]
        above = f"{sum(ratio > 1.25 for ratio in mid)} of {len(mid)}"
        # A check of the committed plans (--committed) does not test cuBLAS.
        variant = len(r["cublas_mismatches"]) if "cublas_mismatches" in r else "-"
        print(
            f"{name:8s} {r['n']:7d} {r['k']:5d}   {r['worst_ratio_1_512']:5.2f} ({worst_m})"
            f"                   {above:24s} {len(r['plan_mismatches'])}           {variant}"
        )
    if args.write_tuned:
        write_tuned({(r["n"], r["k"]): r["plan"] for r in report["shapes"].values() if provable(r)})
    print("\nTUNED = {")
    for r in report["shapes"].values():
        if "plan" in r:
            print(r["plan"])
    print("}")


if __name__ == "__main__":
    main()
