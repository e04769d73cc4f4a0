"""`stackpin-backend tune`: the model's side of tuning. Reads the models' configs, names their weight shapes, and
hands them to the tuner (kernels/triton/tuner.py), which knows shapes and the GPU, never a model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pinned_backend.checkpoint import load_config
from pinned_backend.kernels.triton.plan_files import dump, running_on
from pinned_backend.kernels.triton.tuner import PROVEN, shapes_of, tune
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
