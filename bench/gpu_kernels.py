"""The invariant matmul against cuBLAS at models' weight shapes on one GPU, side by side in one run.

For each model (a checkpoint folder whose config.json gives its shapes: `bench/models/` holds those of the models
the project measures) and each of its weights: the plan the backend would serve there (the plan file that
`stackpin-backend serve` would choose for it on this GPU and Triton, or the rule), and the rule, each timed in turn
with cuBLAS (`time_interleaved`: each captured once in a graph over weight copies that exceed L2, their replays
alternating) at each M of `--m`. The served plan's bits are checked at those M against its M = 512 product; with
`--prove`, every tile of it at every M = 1..512, as the tuner proves the plans it writes. Random weights and
activations: only the shapes matter.

Usage: python -m bench.gpu_kernels OUT.json --model bench/models/qwen3-8b [--model DIR ...] [--m 1,8,32,...]
       [--prove] [--matmul-plans auto|none|FILE]
Prints a table last: for each weight, the served plan's and the rule's ratio to cuBLAS, least to most.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pinned_backend.checkpoint import load_config
from pinned_backend.kernels.triton.launches import Launches
from pinned_backend.kernels.triton.matmul import matmul
from pinned_backend.kernels.triton.plan_files import MatmulPlans, plan_file_for, running_on
from pinned_backend.kernels.triton.timing import time_interleaved, weight_copies
from pinned_backend.kernels.triton.tuner import compile_ahead, default_workers, unproven_tiles
from pinned_backend.model import matmul_shapes

TABLE_M = [1, 8, 32, 64, 128, 256, 384, 512]


def measure_model(
    folder: Path, sizes: list[int], prove: bool, plans_choice: Path | str, launches: Launches
) -> dict[str, Any]:
    shapes = matmul_shapes(load_config(folder))
    device = torch.device("cuda")
    capability = torch.cuda.get_device_capability()
    plan_file = plan_file_for(running_on(device), set(shapes.values()), plans_choice)  # type: ignore[arg-type]
    served, rule = MatmulPlans(plan_file), MatmulPlans()
    weights: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        x = torch.randn(2048 + 77, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).to(torch.bfloat16)
        copies = weight_copies(w)
        plan, rule_plan = served.plan(n, k, capability), rule.plan(n, k, capability)

        def run_plan(a: torch.Tensor, b: torch.Tensor, p: Any = plan) -> torch.Tensor:
            return matmul(a, b, p, launches=launches)

        def run_rule(a: torch.Tensor, b: torch.Tensor, p: Any = rule_plan) -> torch.Tensor:
            return matmul(a, b, p, launches=launches)

        full = run_plan(x[:512], w)
        differ = [m for m in sizes if not torch.equal(run_plan(x[:m], w), full[:m])]
        rows: dict[int, dict[str, float]] = {}
        for m in sizes:
            plan_us, rule_us, cublas_us = time_interleaved([run_plan, run_rule, F.linear], x[:m], copies)
            rows[m] = {"plan_us": plan_us, "rule_us": rule_us, "cublas_us": cublas_us}
        weights[name] = {
            "n": n,
            "k": k,
            "split_k": plan.split_k,
            "tuned": plan_file is not None and (n, k) in plan_file.plans,
            "m_with_other_bits": differ,
            "tiles_with_other_bits": [str(t) for t in unproven_tiles(plan, x, w, launches)]
            if prove
            else None,
            "times": rows,
        }
        del x, w, copies
        torch.cuda.empty_cache()
        print(folder.name, name, n, k, "done", flush=True)
    return {"matmul_plans": None if plan_file is None else plan_file.described(), "weights": weights}


def _range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['device']}  torch {report['torch']}  triton {report['triton']}; invariant / cuBLAS at M = "
          f"{', '.join(map(str, report['m']))}")  # fmt: skip
    print(f"{'model':14} {'weight':8} {'N':>7} {'K':>6} tuned  served plan  rule       other bits")
    for model, result in report["models"].items():
        for name, r in result["weights"].items():
            times = r["times"].values()
            plan = _range([t["plan_us"] / t["cublas_us"] for t in times])
            rule = _range([t["rule_us"] / t["cublas_us"] for t in times])
            bits = len(r["m_with_other_bits"]) + len(r["tiles_with_other_bits"] or [])
            print(
                f"{model:14} {name:8} {r['n']:7d} {r['k']:6d} {'yes' if r['tuned'] else 'no':5}  "
                f"{plan:11}  {rule:9}  {bits}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where to write the JSON report")
    parser.add_argument(
        "--model", type=Path, action="append", required=True, help="a folder with a config.json"
    )
    parser.add_argument("--m", default=",".join(map(str, TABLE_M)), help="the M to time, comma-separated")
    parser.add_argument("--prove", action="store_true", help="prove every served tile at every M = 1..512")
    parser.add_argument("--matmul-plans", default="auto", help="the served plan file: auto, none or a path")
    args = parser.parse_args()
    import triton

    plans = args.matmul_plans if args.matmul_plans in ("auto", "none") else Path(args.matmul_plans)
    sizes = [int(m) for m in args.m.split(",")]
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "m": sizes,
        "models": {},
    }
    launches = Launches()
    # Every served and rule tile of every model, compiled at once in processes of their own before timing.
    capability = torch.cuda.get_device_capability()
    ahead: dict[tuple[int, int], tuple[int, list[Any]]] = {}
    for folder in args.model:
        shapes = set(matmul_shapes(load_config(folder)).values())
        chosen = plan_file_for(running_on(torch.device("cuda")), shapes, plans)  # type: ignore[arg-type]
        for source in (MatmulPlans(chosen), MatmulPlans()):
            for n, k in shapes:
                plan = source.plan(n, k, capability)
                split, tiles = ahead.setdefault((n, k), (plan.split_k, []))
                if split == plan.split_k:
                    tiles.extend(t for _, t in plan.tiles if t not in tiles)
    compile_ahead(ahead, default_workers(), deadline=time.monotonic() + 120)
    for folder in args.model:
        report["models"][folder.name] = measure_model(folder, sizes, args.prove, plans, launches)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)


if __name__ == "__main__":
    main()
