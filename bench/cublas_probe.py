"""Which kernels does cuBLAS run where the invariant matmul is furthest behind it, and with what grid?

The plans' worst sizes sit just past a multiple of a tile's rows (bench/results/h200.md, "Matmul against cuBLAS").
This records, for each weight of the model and each of those sizes, the kernels that `F.linear` and the served plan
launch: their names (cuBLAS's name its tile, its cluster shape and whether it splits K), grids, blocks and GPU times,
from the PyTorch profiler's trace.

Usage: python bench/cublas_probe.py OUT.json [--m=256,264,...]. Prints a table last.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gpu_kernels import SHAPES

from pinned_backend.kernels.triton.matmul import matmul

SIZES = [256, 264, 272, 288, 336, 400, 512]


def kernels_of(fn: Any, repeats: int = 20) -> list[dict[str, Any]]:
    """The GPU kernels one call of `fn` launches, each with its grid, block and median time in microseconds."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    seen: dict[str, dict[str, Any]] = {}
    for event in events:
        if event.get("cat") != "kernel":
            continue
        args = event.get("args", {})
        entry = seen.setdefault(
            event["name"],
            {"name": event["name"], "grid": args.get("grid"), "block": args.get("block"), "us": []},
        )
        entry["us"].append(float(event.get("dur", 0.0)))
    kernels = []
    for entry in seen.values():
        times = sorted(entry.pop("us"))
        entry["calls"] = len(times) // repeats
        entry["us"] = times[len(times) // 2]
        kernels.append(entry)
    return kernels


def main() -> None:
    out_path = sys.argv[1]
    sizes = next(
        ([int(m) for m in a.split("=", 1)[1].split(",")] for a in sys.argv if a.startswith("--m=")), SIZES
    )
    torch.manual_seed(0)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        rows = []
        for m in sizes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            rows.append(
                {
                    "m": m,
                    "cublas": kernels_of(lambda x=x, w=w: F.linear(x, w)),
                    "plan": kernels_of(lambda x=x, w=w: matmul(x, w)),
                }
            )
        report["shapes"][name] = rows
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
        del w
        torch.cuda.empty_cache()
    for name, rows in report["shapes"].items():
        for row in rows:
            for side in ("cublas", "plan"):
                for kernel in row[side]:
                    print(
                        f"{name:8s} {row['m']:4d} {side:6s} {kernel['us']:7.1f} us  grid {kernel['grid']}"
                        f" block {kernel['block']}  {kernel['name'][:120]}"
                    )


if __name__ == "__main__":
    main()
