"""`stackpin-backend`: serve a checkpoint over HTTP, write the tiny model, or tune matmul plans for a GPU.

    stackpin-backend serve --model DIR|FILE.gguf [--host 127.0.0.1] [--port 8000] [--kernel-mode batch_invariant|default]
                           [--device cpu|cuda] [--dtype auto|fastest|fp32|bf16|fp16] [--kv-cache-mb auto|N] [--max-batch-size N]
                           [--max-step-tokens N] [--max-queue N] [--kv-split-size N] [--threads N]
                           [--max-step-graphs N] [--prefix-cache | --no-prefix-cache] [--speculative-tokens K]
                           [--tensor-parallel N]
                           [--pooling last_token|mean] [--matmul-plans auto|tune|none|FILE] [--plan-cache DIR]
                           [--expert-capacity-factor F] [--expert-overflow pass_through|next_expert]
                           [--ready-file PATH]
    stackpin-backend make-tiny DIR
    stackpin-backend tune --model DIR [--model DIR ...] [--out FILE|DIR] [--report FILE] [--budget-s S]
                          [--candidates tuner|all]

`serve` writes its base URL (`http://HOST:PORT`) to the ready file once it listens, so a parent process can wait
for that file and learn the port even when it asked for port 0. Exit codes: 0 after a clean shutdown, 1 when the
model cannot be loaded, 2 on bad arguments. This module parses flags and reports errors; it serves nothing itself.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from aiohttp import web
from pydantic import ValidationError

from pinned_backend.checkpoint import CheckpointError
from pinned_backend.gguf_checkpoint import is_gguf
from pinned_backend.kernels import DEFAULT_KV_SPLIT_SIZE
from pinned_backend.routing import OVERFLOW_POLICIES
from pinned_backend.runtime import BackendSettings
from pinned_backend.server import create_app
from pinned_backend.step_graphs import DEFAULT_MAX_GRAPHS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line that says what to fix; `--help` still shows the whole usage.
        self.exit(2, f"stackpin-backend: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stackpin-backend", description="A batch-invariant LLM server.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a Hugging Face checkpoint folder or a GGUF file")
    serve.add_argument(
        "--model", type=Path, required=True, help="a Hugging Face checkpoint folder, or a GGUF file (*.gguf)"
    )
    serve.add_argument(
        "--model-name",
        help="name to serve it under (default: the folder's name, or the file's without .gguf)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks any free port")
    serve.add_argument("--kernel-mode", choices=["batch_invariant", "default"], default="batch_invariant")
    serve.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    serve.add_argument(
        "--dtype",
        choices=["auto", "fastest", "fp32", "bf16", "fp16"],
        default="auto",
        help="auto: bf16 on cuda, fp32 on cpu; fastest: bf16 where the device computes it natively, else fp32",
    )
    serve.add_argument(
        "--kv-cache-mb",
        type=_kv_cache_mb,
        default="auto",
        help="the KV cache's size, which bounds a request's prompt and answer together; auto (the default): room "
        "for a few of the model's whole contexts, within a quarter of the memory left after the weights",
    )
    serve.add_argument("--max-batch-size", type=int, default=16)
    serve.add_argument("--max-step-tokens", type=int, default=256)
    serve.add_argument("--max-queue", type=int, default=64)
    serve.add_argument(
        "--kv-split-size",
        type=int,
        default=DEFAULT_KV_SPLIT_SIZE,
        help="keys per chunk of the attention's KV reduction: part of the stack, so a stack served with another "
        "split replays only with that split (a multiple of 16, and of 64 on cuda)",
    )
    serve.add_argument(
        "--threads", type=int, help="torch CPU threads (part of the stack; default: torch's choice)"
    )
    serve.add_argument(
        "--max-step-graphs",
        type=int,
        default=DEFAULT_MAX_GRAPHS,
        help="CUDA graphs kept for steps on cuda, each step padded to a captured shape (batch_invariant bits stay "
        "the same); 0 runs every step eagerly",
    )
    serve.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the KV blocks of prompts that start alike, within the KV cache's budget (default: on; changes no "
        "batch_invariant bit)",
    )
    serve.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        metavar="K",
        help="draft tokens by prompt lookup verified per decode step (default 0: off; changes no batch_invariant bit)",
    )
    serve.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="cut the model among N processes, one device each (gloo on the CPU, NCCL on GPUs); under "
        "batch_invariant every N, 1 included, gives the same bits (default: one process, the model whole)",
    )
    serve.add_argument(
        "--pooling",
        choices=["last_token", "mean"],
        default="last_token",
        help="how /v1/embeddings pools a sequence's final hidden states (part of the stack)",
    )
    serve.add_argument(
        "--matmul-plans",
        default="auto",
        help="the matmul plan file on cuda in batch_invariant mode: auto (the shipped one for this GPU and Triton "
        "that holds the most of the model's weight shapes), tune (that one where it holds them all, else plans "
        "tuned and proven here at the model's first load, kept in --plan-cache for the next), none (the rule for "
        "every weight), or a file, e.g. one `tune` wrote; part of the stack",
    )
    serve.add_argument(
        "--plan-cache",
        type=Path,
        help="where --matmul-plans tune keeps the plans it tunes (default: $XDG_CACHE_HOME/stackpin/plans, "
        "else ~/.cache/stackpin/plans)",
    )
    serve.add_argument(
        "--expert-capacity-factor",
        type=float,
        help="a mixture-of-experts model: cap each expert at ceil(F * step tokens * k / experts) tokens per step, "
        "so that answers depend on the batch (part of the stack, whose kernel_mode then says batch_invariant_kernels "
        "rather than batch_invariant; default: dropless routing)",
    )
    serve.add_argument(
        "--expert-overflow",
        choices=list(OVERFLOW_POLICIES),
        help="with --expert-capacity-factor: a refused token is passed through unprocessed, or rerouted to its "
        "next-ranked expert with room (default: pass_through)",
    )
    serve.add_argument("--ready-file", type=Path, help="write the base URL here once listening")
    tiny = commands.add_parser("make-tiny", help="train and write the tiny model")
    tiny.add_argument("directory", type=Path)
    tune = commands.add_parser(
        "tune", help="tune and prove matmul plans for models' weight shapes on this GPU, into a plan file"
    )
    tune.add_argument(
        "--model",
        type=Path,
        action="append",
        required=True,
        help="a checkpoint folder; only its config.json is read (repeat for several models)",
    )
    tune.add_argument(
        "--out", type=Path, help="the plan file to write (default: named for the GPU, Triton, models)"
    )
    tune.add_argument("--report", type=Path, help="also write every timing and ratio here, as JSON")
    tune.add_argument(
        "--budget-s", type=float, default=120.0, help="seconds for compiling and timing tiles (default 120)"
    )
    tune.add_argument(
        "--candidates",
        choices=["tuner", "all"],
        default="tuner",
        help="the candidate tiles (matmul_candidates.py)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "make-tiny":
        from pinned_backend.tiny import make_tiny

        print(make_tiny(args.directory))
        return 0
    if args.command == "tune":
        return _tune(parser, args)
    matmul_plans = (
        args.matmul_plans if args.matmul_plans in ("auto", "tune", "none") else Path(args.matmul_plans)
    )
    try:
        settings = BackendSettings(
            model=args.model,
            model_name=args.model_name,
            host=args.host,
            port=args.port,
            kernel_mode=args.kernel_mode,
            device=args.device,
            dtype=args.dtype,
            kv_cache_mb=args.kv_cache_mb,
            max_batch_size=args.max_batch_size,
            max_step_tokens=args.max_step_tokens,
            max_queue=args.max_queue,
            kv_split_size=args.kv_split_size,
            threads=args.threads,
            max_step_graphs=args.max_step_graphs,
            pooling=args.pooling,
            matmul_plans=matmul_plans,
            plan_cache=args.plan_cache,
            expert_capacity_factor=args.expert_capacity_factor,
            expert_overflow=args.expert_overflow,
            prefix_cache=args.prefix_cache,
            speculative_tokens=args.speculative_tokens,
            tensor_parallel=args.tensor_parallel,
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        # The field alone: a union's member (`kv_cache_mb`'s number or "auto") adds its own step to the location.
        field = "--" + str(error["loc"][0]).replace("_", "-") if error["loc"] else ""
        parser.error(f"{field}: {error['msg']}" if error["loc"] else error["msg"])
    if not args.model.is_dir() and not is_gguf(args.model):
        parser.error(f"--model: {args.model} is not a directory (nor a .gguf file)")
    if is_gguf(args.model) and not args.model.is_file():
        parser.error(f"--model: {args.model}: file not found")
    try:
        asyncio.run(_serve(settings, args.ready_file))
    except (CheckpointError, ValueError, RuntimeError) as exc:
        print(f"stackpin-backend: cannot serve {args.model}: {exc}", file=sys.stderr)
        return 1
    return 0


def _kv_cache_mb(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a number of MB") from None


def _tune(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pinned_backend.tune import tune_models

    for folder in args.model:
        if not (folder / "config.json").is_file():
            parser.error(f"--model: {folder} has no config.json")
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")
    try:
        out = tune_models(args.model, args.out, args.report, args.budget_s, args.candidates)
    except (CheckpointError, RuntimeError) as exc:
        print(f"stackpin-backend: cannot tune: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _say(line: str) -> None:
    print(f"stackpin-backend: {line}", file=sys.stderr, flush=True)


async def _serve(settings: BackendSettings, ready_file: Path | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Installed before the ready file appears, so a parent that stops us at once still gets a clean exit.
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    runner = web.AppRunner(create_app(settings, report=_say), handle_signals=False)
    await runner.setup()  # loads the model; errors surface here, before anything listens
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        port = runner.addresses[0][1]
        url = f"http://{settings.host}:{port}"
        if ready_file is not None:
            # Written whole, then renamed, so a watcher never reads half a URL.
            partial = ready_file.with_name(ready_file.name + ".partial")
            partial.write_text(url + "\n")
            partial.replace(ready_file)
        _say(f"serving {settings.served_name} at {url}")
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
