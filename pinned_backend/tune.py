"""`stackpin-backend tune`, and `--matmul-plans tune` at a model's first load: the model's side of tuning. Reads the
models' configs, names their weight shapes, and hands them to the tuner (kernels/triton/tuner.py), which knows
shapes and the GPU, never a model."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from pinned_backend.checkpoint import load_config
from pinned_backend.kernels.triton.plan_files import PlanFile, Proven, choose, dump, load, running_on, shipped
from pinned_backend.kernels.triton.tuner import PROVEN, ShapeTune, shapes_of, tune
from pinned_backend.model import matmul_shapes


def tune_models(
    folders: list[Path], out: Path, report: Path | None, budget_s: float, families: str = "tuner"
) -> Path:
    """`stackpin-backend tune`: tune every weight shape of the models in `folders` (their config.json) on this
    GPU, print a table, and write the plans proven into a plan file (`out`, or in the folder `out` one named for the
    GPU, Triton and models), and every timing into `report`. Returns the plan file's path."""
    if not torch.cuda.is_available():
        raise RuntimeError("tuning needs a CUDA GPU, and torch sees none")
    models = [(folder.resolve().name, matmul_shapes(load_config(folder))) for folder in folders]
    proven = running_on(torch.device("cuda"))
    results = tune(shapes_of(models), budget_s, families)
    plans = {(r.n, r.k): r.plan for r in results if r.plan is not None}
    if not plans:
        raise RuntimeError("no tile passed for any weight shape")
    names = [name for name, _ in models]
    slug = "-".join(proven.gpu.lower().split())
    path = out / f"{slug}_triton-{proven.triton}_{'_'.join(names)}.json" if out.is_dir() else out
    path.write_text(dump(proven, names, plans, PROVEN))
    if report is not None:
        document = {"proven_on": str(proven), "budget_s": budget_s, "families": families}
        document["shapes"] = [r.report() for r in results]
        report.write_text(json.dumps(document, indent=1) + "\n")
    print(f"{proven}; plan file {path}")
    print(f"{'weights':40} {'N':>7} {'K':>6} split tiles  worst plan / cuBLAS (M)  worst rule / cuBLAS (M)")
    for r in results:
        plan, rule = r.ratios(r.plan_us), r.ratios(r.rule_us)
        worst_plan = max(plan, key=plan.__getitem__, default=None)
        worst_rule = max(rule, key=rule.__getitem__, default=None)
        print(
            f"{','.join(r.names)[:40]:40} {r.n:7d} {r.k:6d} {r.split:5d} {r.timed:5d}  "
            + (f"{plan[worst_plan]:10.2f} ({worst_plan:3d})" if worst_plan else f"{'no plan':>16}")
            + (f"   {rule[worst_rule]:18.2f} ({worst_rule:3d})" if worst_rule else "")
        )
    return path


# Where plans tuned at a model's first load are kept (`--matmul-plans tune`), unless `--plan-cache` says otherwise.
DEFAULT_PLAN_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stackpin" / "plans"
# Seconds of compiling and timing tiles for one model's untuned shapes at its first load.
LOAD_TUNE_BUDGET_S = 120.0


def plans_at_load(
    proven: Proven,
    model: str,
    shapes: dict[str, tuple[int, int]],
    cache: Path,
    report: Callable[[str], None],
    budget_s: float = LOAD_TUNE_BUDGET_S,
    tuner: Callable[..., list[ShapeTune]] = tune,
) -> PlanFile | None:
    """`--matmul-plans tune`: the plan file a model takes, tuned and proven here the first time it loads. The shipped
    file that holds the most of its shapes where that holds them all; else the file this cache keeps for the same
    GPU, Triton and shapes; else one written now: the shipped plans, and plans tuned and proven (tuner.py) for the
    shapes no shipped file holds, named for the GPU, Triton and a digest of the shapes, so that the stack that names
    it (its name and SHA-256) names these plans alone. A shape for which no tile passes keeps the rule."""
    wanted = set(shapes.values())
    base = choose(shipped(), proven, wanted)
    if base is not None and base.covers(wanted) == len(wanted):
        return base
    digest = hashlib.sha256(json.dumps(sorted(wanted)).encode()).hexdigest()[:16]
    slug = "-".join(proven.gpu.lower().split())
    path = cache / f"{slug}_triton-{proven.triton}_tuned-{digest}.json"
    if path.is_file():
        kept = load(path)
        if kept.proven == proven:
            report(f"matmul plans tuned at an earlier load: {path}")
            return kept
    missing = {name: shape for name, shape in shapes.items() if base is None or shape not in base.plans}
    report(
        f"tuning matmul plans for {len(set(missing.values()))} weight shapes no shipped file holds (~{budget_s:.0f} s)"
    )
    results = tuner(shapes_of([(model, missing)]), budget_s, log=lambda _: None)
    plans = {**(base.plans if base is not None else {}), **{(r.n, r.k): r.plan for r in results if r.plan}}
    if not plans:
        report("no tile passed for any weight shape: the rule serves every matmul")
        return None
    cache.mkdir(parents=True, exist_ok=True)
    names = sorted({model, *(base.models if base is not None else ())})
    # Written whole, then renamed: a process loading the same model meanwhile sees the old file or the new one.
    with tempfile.NamedTemporaryFile("w", dir=cache, suffix=".part", delete=False, encoding="utf-8") as part:
        part.write(dump(proven, names, plans, PROVEN))
    os.replace(part.name, path)
    report(f"matmul plans tuned and proven for this GPU: {path}")
    return load(path)
