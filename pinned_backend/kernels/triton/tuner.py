"""Tuning matmul plans for a model's weight shapes on the GPU it runs on, within a time bound, and proving them.

For each weight shape (N, K), in the rule's reduction order (`rule_split`), the tuner times candidate tiles
(matmul_candidates.py, the rule's own first) at the sizes `TIMED_M` and at one prefill size, each against random
operands of the shape (only the shape matters: the kernels' speed does not depend on the values), and makes a plan
of the fastest tile at each timed M, up to that M. It then proves the plan: every tile it keeps must give the bits
of the plan's M = 512 product at every M = 1..512, at rows shifted by 1, 5, 64 and 77, and at M = 2048; a tile that
does not is dropped and the plan made again without it. Last, the plan and the rule are timed in turn with cuBLAS
at every timed M, for the record. The plans go to a plan file (plan_files.py) keyed by this GPU and Triton.

The time bound covers compiling and timing candidates: each shape gets a share of what is left in proportion to its
candidates and K, and a shape whose share runs out keeps the best of the tiles timed so far (the rule's tiles come
first, so it never does worse than the rule at the sizes timed). Compiling, which dominates a tune, runs first in
processes of its own, filling Triton's cache for the timing that follows. This module needs a CUDA GPU.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .launches import Launches
from .matmul import matmul
from .matmul_candidates import candidate_tiles
from .matmul_plans import LARGE_M, MatmulPlan, MatmulTile, rule_plan, rule_split
from .timing import time_alone, time_interleaved, weight_copies

TIMED_M = (1, 8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
PREFILL_M = 2048  # chooses the tile past M = 512
SHIFTS = (1, 5, 64, 77)
# Tiles timed at the prefill size: those wide enough to be bound by arithmetic there.
_PREFILL_MIN_AREA = 128 * 128
PROVEN = (
    "every tile of each plan gave the bits of the plan's M = 512 product at every M = 1..512, at rows shifted by "
    + ", ".join(map(str, SHIFTS))
    + f", and at M = {PREFILL_M}"
)


@dataclass
class ShapeTune:
    """One weight shape's tune: its plan (None where no tile passed), what was timed, and the final ratios."""

    n: int
    k: int
    names: list[str]
    split: int
    plan: MatmulPlan | None = None
    timed: int = 0
    untimed: int = 0  # candidates the shape's share of the time bound left out
    failed: dict[str, str] = field(default_factory=dict)  # tile -> why it was dropped
    cublas_us: dict[int, float] = field(default_factory=dict)
    plan_us: dict[int, float] = field(default_factory=dict)
    rule_us: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0

    def ratios(self, times: dict[int, float]) -> dict[int, float]:
        return {m: times[m] / self.cublas_us[m] for m in times}

    def report(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "k": self.k,
            "weights": self.names,
            "split_k": self.split,
            "tiles_timed": self.timed,
            "tiles_left_untimed": self.untimed,
            "tiles_dropped": self.failed,
            "plan": None if self.plan is None else [[m, str(t)] for m, t in self.plan.tiles],
            "cublas_us": self.cublas_us,
            "plan_us": self.plan_us,
            "rule_us": self.rule_us,
            "plan_ratio": self.ratios(self.plan_us),
            "rule_ratio": self.ratios(self.rule_us),
            "seconds": self.seconds,
        }


def tune(
    shapes: dict[tuple[int, int], list[str]],
    budget_s: float,
    families: str = "tuner",
    log: Callable[[str], None] = print,
    compile_workers: int | None = None,
) -> list[ShapeTune]:
    """Tune and prove a plan for each (N, K) of `shapes` (the weights' names for each), within `budget_s` seconds
    of compiling and timing; proving and the final timings come on top (a few seconds a shape)."""
    start = time.monotonic()
    order = sorted(shapes)
    candidates = {shape: candidate_tiles(*shape, rule_split(shape[1]), families) for shape in order}
    workers = compile_workers if compile_workers is not None else default_workers()
    ahead = {shape: (rule_split(shape[1]), tiles) for shape, tiles in candidates.items()}
    compile_ahead(ahead, workers, deadline=start + budget_s / 2, log=log)
    results = []
    for i, (n, k) in enumerate(order):
        costs = {s: len(candidates[s]) * s[1] for s in order[i:]}
        left = start + budget_s - time.monotonic()
        deadline = time.monotonic() + max(0.0, left) * costs[(n, k)] / sum(costs.values())
        result = tune_shape(n, k, shapes[(n, k)], candidates[(n, k)], deadline, log)
        results.append(result)
    return results


def tune_shape(
    n: int,
    k: int,
    names: list[str],
    candidates: list[MatmulTile],
    deadline: float,
    log: Callable[[str], None] = print,
) -> ShapeTune:
    started = time.monotonic()
    split = rule_split(k)
    result = ShapeTune(n, k, names, split)
    x, w, copies = _operands(n, k)
    launches = Launches()
    reference = x[:64].double() @ w.double().T
    result.cublas_us = {m: time_alone(_cublas, x[:m], copies) for m in TIMED_M}
    times: dict[MatmulTile, dict[int, float]] = {}
    for index, tile in enumerate(candidates):
        if time.monotonic() > deadline:
            result.untimed = len(candidates) - index
            break
        plan = MatmulPlan(split, ((LARGE_M, tile),))
        run = _runner(plan, tile, launches)
        try:
            out = run(x[:64], w)
            err = float((out.double() - reference).norm() / reference.norm())
            if not err < 1e-2:
                raise ValueError(f"relative error {err:.1e} against float64")
            times[tile] = {m: time_alone(run, x[:m], copies) for m in TIMED_M}
        except Exception as exc:  # a tile that does not compile or fit is a result, not a crash
            result.failed[str(tile)] = repr(exc)[:300]
    result.timed = len(times)
    # Past the timings at M <= 512, since a small product runs slower for a while after a large one.
    for tile, taken in times.items():
        wide = tile.gluon or tile.tma or tile.block_m * tile.block_n >= _PREFILL_MIN_AREA
        taken[PREFILL_M] = (
            time_alone(_runner(MatmulPlan(split, ((LARGE_M, tile),)), tile, launches), x[:PREFILL_M], copies)
            if wide
            else math.inf
        )
    while times:
        plan = plan_from(times, split)
        bad = unproven_tiles(plan, x, w, launches)
        if not bad:
            result.plan = plan
            break
        for tile in bad:
            result.failed[str(tile)] = "gave other bits than the plan's other tiles"
            times.pop(tile)
    if result.plan is not None:
        served, rule = _runner(result.plan, None, launches), _runner(rule_plan(n, k), None, launches)
        for m in TIMED_M:
            result.plan_us[m], result.rule_us[m], result.cublas_us[m] = time_interleaved(
                [served, rule, _cublas], x[:m], copies
            )
    result.seconds = time.monotonic() - started
    worst = max(result.ratios(result.plan_us).values(), default=math.nan)
    log(f"{'/'.join(names)} {n}x{k}: {result.timed} tiles timed, worst ratio to cuBLAS {worst:.2f}")
    return result


def plan_from(times: dict[MatmulTile, dict[int, float]], split: int) -> MatmulPlan:
    """The fastest tile at each timed M (and at the prefill size, for every larger M), as a plan of M ranges, each
    ending at a timed M; neighbouring ranges of one tile merge."""
    chosen: list[tuple[int, MatmulTile]] = []
    for m in (*TIMED_M, PREFILL_M):
        tile = min(times, key=lambda t: times[t][m])
        bound = LARGE_M if m == PREFILL_M else m
        if chosen and chosen[-1][1] == tile:
            chosen[-1] = (bound, tile)
        else:
            chosen.append((bound, tile))
    return MatmulPlan(split, tuple(chosen))


def unproven_tiles(
    plan: MatmulPlan, x: torch.Tensor, w: torch.Tensor, launches: Launches
) -> list[MatmulTile]:
    """The tiles of `plan` that give any row other bits than the plan's own M = 512 product, at any M = 1..512, at
    the shifted row windows or at M = 2048 (x has at least 2048 + 77 rows)."""
    reference = matmul(x[:512], w, plan, launches=launches).view(torch.int16)
    bad = []
    for tile in dict.fromkeys(t for _, t in plan.tiles):
        differs = torch.zeros((), dtype=torch.bool, device=x.device)
        for m in range(1, 513):
            out = matmul(x[:m], w, plan, tile, launches=launches).view(torch.int16)
            differs |= (out != reference[:m]).any()
        for j in SHIFTS:
            out = matmul(x[j : j + 512], w, plan, tile, launches=launches).view(torch.int16)
            differs |= (out[: 512 - j] != reference[j:]).any()
        out = matmul(x[:PREFILL_M], w, plan, tile, launches=launches).view(torch.int16)
        differs |= (out[:512] != reference).any()
        if bool(differs):
            bad.append(tile)
    return bad


def _runner(
    plan: MatmulPlan, tile: MatmulTile | None, launches: Launches
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return matmul(a, b, plan, tile, launches=launches)

    return run


def _cublas(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.linear(a, b)


def _operands(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Seeded activations (enough rows for the prefill size and the shifted windows), a weight of the shape with
    std 1/sqrt(K), and copies of it that together exceed L2."""
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(PREFILL_M + max(SHIFTS), k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    return x, w, weight_copies(w)


def compile_ahead(
    plans: dict[tuple[int, int], tuple[int, list[MatmulTile]]],
    workers: int,
    deadline: float,
    log: Callable[[str], None] = print,
) -> None:
    """Compile each (N, K)'s tiles, in its (split, tiles), in `workers` processes at once, into Triton's cache,
    which the calling process then loads from. Best effort, and cut at `deadline`: what is not compiled here
    compiles when first launched."""
    if workers <= 1:
        return
    jobs = [(n, k, split, tile) for (n, k), (split, tiles) in plans.items() for tile in tiles]
    started = time.monotonic()
    context = multiprocessing.get_context("spawn")
    done = 0
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = [pool.submit(_compile_one, *job) for job in jobs]
            for future in futures:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    done += bool(future.result(timeout=left))
                except Exception:
                    continue
            for future in futures:
                future.cancel()
    except Exception as exc:
        log(f"compiling ahead failed ({exc!r}); tiles compile when first launched")
        return
    log(f"compiled {done} of {len(jobs)} matmul tiles ahead in {time.monotonic() - started:.0f} s")


def default_workers() -> int:
    return min(16, os.cpu_count() or 1)


def _compile_one(n: int, k: int, split: int, tile: MatmulTile) -> bool:
    """Compile `tile` for a weight [N, K] by launching it once on operands of that shape."""
    x = torch.zeros(16, k, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
    matmul(x, w, MatmulPlan(split, ((LARGE_M, tile),)), tile)
    torch.cuda.synchronize()
    return True


def shapes_of(models: Iterable[tuple[str, dict[str, tuple[int, int]]]]) -> dict[tuple[int, int], list[str]]:
    """Each distinct (N, K) of the models' weights, with the `model.weight` names that have it."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for model, weights in models:
        for weight, shape in weights.items():
            shapes.setdefault(shape, []).append(f"{model}.{weight}")
    return shapes
