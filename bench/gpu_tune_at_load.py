"""Matmul plans tuned at a model's first load (`--matmul-plans tune`), proven on models the shipped plans were not
tuned for, against cuBLAS, on one GPU.

For each model folder (a config.json): the plan file `tune.plans_at_load` gives it with an empty cache (the first
load: the shipped plans where they hold a shape, plans tuned and proven here for the rest, `--budget-s` seconds of
compiling and timing), how long that took, and how long the second load took (the kept file); then every weight
shape's matmul timed with the plan that file gives it, with the rule (no plan), and with cuBLAS, interleaved, at each
M (bench/gpu_kernels.py's `measure_model`, which also checks that every M gives a row the bits M = 512 gives it).

Usage (on a GPU machine, from the repository root):
    python -m bench.gpu_tune_at_load OUT.json --cache DIR [--budget-s 60] --model bench/models/qwen2.5-7b ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench.gpu_kernels import TABLE_M, measure_model
from pinned_backend.checkpoint import load_config
from pinned_backend.kernels.triton.launches import Launches
from pinned_backend.kernels.triton.plan_files import running_on
from pinned_backend.model import matmul_shapes
from pinned_backend.tune import plans_at_load


def summary(weights: dict[str, Any]) -> dict[str, Any]:
    """Per weight: the worst and median of plan / cuBLAS and of rule / cuBLAS over the timed M."""
    out = {}
    for name, weight in weights.items():
        plan = [row["plan_us"] / row["cublas_us"] for row in weight["times"].values()]
        rule = [row["rule_us"] / row["cublas_us"] for row in weight["times"].values()]
        out[name] = {
            "n": weight["n"],
            "k": weight["k"],
            "tuned": weight["tuned"],
            "plan_worst": max(plan),
            "plan_median": statistics.median(plan),
            "rule_worst": max(rule),
            "rule_median": statistics.median(rule),
            "m_with_other_bits": weight["m_with_other_bits"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", type=Path, action="append", required=True)
    parser.add_argument("--cache", type=Path, required=True, help="the plan cache (empty for a first load)")
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--m", default=",".join(map(str, TABLE_M)))
    args = parser.parse_args()
    device = torch.device("cuda")
    sizes = [int(m) for m in args.m.split(",")]
    report: dict[str, Any] = {
        "command": f"python -m bench.gpu_tune_at_load OUT.json --cache DIR --budget-s {args.budget_s:g} "
        + " ".join(f"--model {m}" for m in args.model),
        "date": datetime.now(UTC).date().isoformat(),
        "proven_on": str(running_on(device)),
        "m": sizes,
        "models": {},
    }
    for folder in args.model:
        shapes = matmul_shapes(load_config(folder))
        started = time.monotonic()
        first = plans_at_load(
            running_on(device), folder.name, shapes, args.cache, print, budget_s=args.budget_s
        )
        first_s = time.monotonic() - started
        started = time.monotonic()
        again = plans_at_load(
            running_on(device), folder.name, shapes, args.cache, print, budget_s=args.budget_s
        )
        again_s = time.monotonic() - started
        assert (first is None) == (again is None) and (first is None or first.sha256 == again.sha256)  # type: ignore[union-attr]
        choice: Path | str = "none" if first is None else (args.cache / first.name)
        if first is not None and not (args.cache / first.name).is_file():
            choice = "auto"  # a shipped file held every shape
        measured = measure_model(folder, sizes, False, choice, Launches())
        report["models"][folder.name] = {
            "first_load_s": first_s,
            "second_load_s": again_s,
            "matmul_plans": measured["matmul_plans"],
            "summary": summary(measured["weights"]),
            "weights": measured["weights"],
        }
        print(json.dumps({folder.name: report["models"][folder.name]["summary"]}), flush=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
