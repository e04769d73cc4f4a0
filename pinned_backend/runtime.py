"""Assembling a serving backend from its settings: checkpoint, tokenizer, kernels, KV cache, engine, stack.

`BackendSettings` is the one validated configuration object (the CLI builds it from its flags; nothing reads
the environment). `load_runtime` loads what the settings name and describes the stack from what was actually
loaded: the weight files' digest, the dtype, the device the kernels run on, the kernel mode they report. The
runtime's engine runner is not started here; the server starts and stops it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pinned_backend.allocator import keep_freed_memory
from pinned_backend.checkpoint import ModelConfig
from pinned_backend.embeddings import Pooling
from pinned_backend.engine import Engine, EngineConfig, StepStats
from pinned_backend.grammar import GrammarCompiler
from pinned_backend.harmony import answer_text, is_harmony
from pinned_backend.kernels import DEFAULT_KV_SPLIT_SIZE, Kernels, onednn, select_kernels
from pinned_backend.kvcache import (
    KV_CONTEXTS,
    KV_MEMORY_SHARE,
    BlockAllocator,
    PagedKVCache,
    automatic_budget,
)
from pinned_backend.loading import Report, default_name, load_checkpoint
from pinned_backend.memory import available_bytes
from pinned_backend.model import Transformer, matmul_shapes
from pinned_backend.parallel.shards import check_shardable, reduction_tree
from pinned_backend.parallel.steps import ParallelModel, start_parallel
from pinned_backend.routing import ExpertRouting, OverflowPolicy
from pinned_backend.runner import EngineRunner
from pinned_backend.stack import (
    batching_policy,
    build_stack,
    detect_hardware,
    detect_software,
    embedding_method,
)
from pinned_backend.step_graphs import DEFAULT_MAX_GRAPHS
from pinned_backend.tokenizer import Tokenizer
from pinned_backend.tokenpieces import TokenPieces

if TYPE_CHECKING:
    from pinned_backend.kernels.triton.plan_files import PlanFile

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAX_SPECULATIVE_TOKENS = 16  # a verify pass of more drafts than this would mostly compute rejected ones


class BackendSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path  # a Hugging Face checkpoint folder or a GGUF file
    model_name: str | None = None  # defaults to the folder's name, or the GGUF file's without `.gguf`
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    kernel_mode: Literal["batch_invariant", "default"] = "batch_invariant"
    device: Literal["cpu", "cuda"] = "cpu"
    # auto: bf16 on a GPU, fp32 on the CPU; fastest: bf16 wherever the device multiplies it natively (a GPU, a CPU
    # with bf16 dot products, whose weights oneDNN packs: kernels.onednn), fp32 elsewhere.
    dtype: Literal["auto", "fastest", "fp32", "bf16", "fp16"] = "auto"
    # The KV cache's size; "auto": room for a few whole contexts, within a share of the memory available
    # (kvcache.automatic_budget).
    kv_cache_mb: Annotated[float, Field(gt=0, allow_inf_nan=False)] | Literal["auto"] = "auto"
    block_size: int = Field(default=16, ge=1)
    kv_split_size: int = Field(default=DEFAULT_KV_SPLIT_SIZE, ge=1)
    max_batch_size: int = Field(default=16, ge=1)
    max_step_tokens: int = Field(default=256, ge=1)
    max_queue: int = Field(default=64, ge=0)
    default_max_tokens: int = Field(default=256, ge=1)
    threads: int | None = Field(default=None, ge=1)  # torch's CPU threads; None keeps torch's choice
    # CUDA graphs kept for steps on a GPU; 0 runs every step eagerly. Not part of the stack: padding a step to a
    # captured shape leaves every batch_invariant answer's bits as they are.
    max_step_graphs: int = Field(default=DEFAULT_MAX_GRAPHS, ge=0)
    # How /v1/embeddings pools a sequence's final hidden states: part of the stack.
    pooling: Literal["last_token", "mean"] = "last_token"
    # The matmul plan file of batch_invariant mode on a GPU: "auto" (the shipped file for this GPU and Triton that
    # holds the most of the model's weight shapes), "tune" (that file where it holds them all, else plans tuned and
    # proven here at the model's first load and kept in `plan_cache`: tune.py), "none" (the rule for every weight),
    # or a file's path. The stack names the file and its digest.
    matmul_plans: Path | Literal["auto", "tune", "none"] = "auto"
    plan_cache: Path | None = None  # None: tune.DEFAULT_PLAN_CACHE
    # A mixture-of-experts model's routing: dropless unless a capacity factor caps each expert's tokens per step.
    expert_capacity_factor: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    expert_overflow: OverflowPolicy | None = None  # what a refused token does; pass_through unless said
    # Serving features that change no batch_invariant bit, so the stack says them outside its fingerprint
    # (stack.py): the prefix cache, sharing the KV cache's budget, and speculative decoding by prompt lookup with
    # this many draft tokens a step (0: off).
    prefix_cache: bool = True
    speculative_tokens: int = Field(default=0, ge=0, le=MAX_SPECULATIVE_TOKENS)
    # Ranks the model is cut among (parallel/): one process per rank, each on one device. Any degree, 1 included,
    # sums the row-parallel products over the model's fixed chunks, so that under batch_invariant every degree
    # gives the same bits; None computes them whole in one process (another stack). The degree itself is outside
    # the fingerprint (stack.py).
    tensor_parallel: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> BackendSettings:
        if self.max_step_tokens < self.max_batch_size:
            raise ValueError(
                f"max_step_tokens ({self.max_step_tokens}) must be at least max_batch_size ({self.max_batch_size})"
            )
        if self.device == "cuda" and self.dtype == "fp32":
            # Both modes run the Triton kernels on a GPU, written for 16-bit operands (a float32 tl.dot would
            # quietly compute in TF32).
            raise ValueError(
                "the kernels on cuda run bf16 or fp16 on the tensor cores; choose --dtype bf16 (or fp16)"
            )
        if self.expert_overflow is not None and self.expert_capacity_factor is None:
            raise ValueError("--expert-overflow applies only with --expert-capacity-factor")
        if self.kv_split_size % self.block_size:
            raise ValueError(
                f"--kv-split-size {self.kv_split_size} must be a multiple of the KV cache's block size, "
                f"{self.block_size}"
            )
        if self.tensor_parallel is not None and self.device == "cuda":
            available = torch.cuda.device_count()
            if self.tensor_parallel > available:
                raise ValueError(
                    f"--tensor-parallel {self.tensor_parallel} needs a GPU per rank; torch sees {available}"
                )
        if self.device == "cuda":
            from pinned_backend.kernels.triton.attention import KV_TILE

            if self.kv_split_size % KV_TILE:
                raise ValueError(
                    f"--kv-split-size {self.kv_split_size}: the GPU attention walks keys in tiles of {KV_TILE}; "
                    f"choose a multiple of {KV_TILE}"
                )
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device == "cuda" else torch.float32
        if self.dtype == "fastest":
            return torch.bfloat16 if self.device == "cuda" or onednn.packs(torch.bfloat16) else torch.float32
        return DTYPES[self.dtype]

    @property
    def expert_routing(self) -> ExpertRouting:
        return ExpertRouting(self.expert_capacity_factor, self.expert_overflow or "pass_through")

    @property
    def served_name(self) -> str:
        return self.model_name or default_name(self.model)


@dataclass
class Runtime:
    settings: BackendSettings
    tokenizer: Tokenizer
    engine: Engine
    runner: EngineRunner
    stack: dict[str, Any]
    max_model_len: int
    pieces: TokenPieces
    model: Transformer | ParallelModel
    pooling: Pooling
    grammars: GrammarCompiler

    def close(self) -> None:
        """Stop the engine's thread (if it ran), then any other ranks."""
        if self.runner.alive:
            self.runner.stop()
        if isinstance(self.model, ParallelModel):
            self.model.close()


def load_runtime(
    settings: BackendSettings,
    on_step: Callable[[StepStats], None] | None = None,
    report: Report = lambda _: None,
) -> Runtime:
    """Load the checkpoint and build the engine; raises CheckpointError or ValueError saying what is wrong.
    `report` hears each loading step as it starts."""
    device = torch.device(settings.device)
    if settings.threads is not None:
        # Before the kernels are made: they record the count, which the stack reports (a BLAS splits a GEMM
        # differently for another count, so it is part of what can change an answer).
        torch.set_num_threads(settings.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device; use --device cpu")
    if device.type == "cpu":
        keep_freed_memory()
    dtype = settings.torch_dtype
    checkpoint = load_checkpoint(settings.model, dtype, report)
    config, tokenizer = checkpoint.config, checkpoint.tokenizer
    kernels, plan_file = kernels_for(settings, config, device, report)
    # The CPU sets' attention and per-row ops: compiled, or torch ops where no compiler built them (other bits).
    cpu_kernels = getattr(kernels, "cpu_kernels", None)
    if cpu_kernels == "torch":
        why = getattr(kernels, "kernels_unbuilt", "")
        report(
            f"the compiled CPU kernels are not built ({why}); torch ops serve instead, and the stack says so (their "
            "answers' bits differ)"
        )
    invariant_on_gpu = device.type == "cuda" and settings.kernel_mode == "batch_invariant"
    model: Transformer | ParallelModel
    if settings.tensor_parallel is None:
        model = Transformer(
            config, checkpoint.weights, kernels, device, dtype, routing=settings.expert_routing
        )
        cache_config = config
    else:
        check_shardable(config, settings.tensor_parallel)
        report(f"starting {settings.tensor_parallel - 1} more tensor-parallel ranks")
        model = start_parallel(
            settings.model_dump_json(),
            settings.tensor_parallel,
            config,
            checkpoint.weights,
            kernels,
            device,
            dtype,
        )
        cache_config = model.local.config
    try:
        num_blocks = PagedKVCache.blocks_for_budget(
            config, _kv_budget(settings, config, device, report), settings.block_size, dtype
        )
        cache = PagedKVCache(cache_config, num_blocks, settings.block_size, device, dtype)
        if isinstance(model, ParallelModel):
            model.start(num_blocks)
    except BaseException:
        if isinstance(model, ParallelModel):
            model.close()
        raise
    # Both modes replay their steps as CUDA graphs on a GPU (under default kernels the padding may move bits, which
    # that mode never promised, and it runs default at its fastest). A mixture-of-experts step with dropless routing
    # too (its dispatch never leaves the GPU); with a capacity factor a padded step would count its padding tokens
    # against the experts' capacity, so such steps run as they come, eagerly.
    graphed = (
        device.type == "cuda"
        and settings.tensor_parallel is None  # a step's collectives are not captured
        and (config.moe is None or settings.expert_routing.capacity_factor is None)
    )
    engine_config = EngineConfig(
        max_model_len=config.max_position_embeddings,
        num_blocks=num_blocks,
        block_size=settings.block_size,
        max_batch_size=settings.max_batch_size,
        max_step_tokens=settings.max_step_tokens,
        max_queue=settings.max_queue,
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        step_graphs=settings.max_step_graphs if graphed else 0,
        prefix_cache=settings.prefix_cache,
        speculative_tokens=settings.speculative_tokens,
    )
    # A harmony checkpoint's answer is its final channel's text (harmony.py); any other's, its decoded tokens.
    detokenize = answer_text(tokenizer.decode) if is_harmony(tokenizer.chat_template) else tokenizer.decode
    engine = Engine(
        model, cache, BlockAllocator(num_blocks), kernels, engine_config, detokenize, device, on_step
    )
    generation, detail = detect_hardware(device)
    if invariant_on_gpu:
        # The plans decide the matmuls' reduction orders, and live outside the source the backend version digests.
        detail = {**detail, "matmul_plans": None if plan_file is None else plan_file.described()}
    if cpu_kernels is not None:
        detail = {**detail, "kernels": cpu_kernels}
    stack = build_stack(
        model=settings.served_name,
        weights_sha256=checkpoint.weights_sha256,
        quantisation=checkpoint.quantisation,
        hardware=(generation, detail),
        kernel_mode=kernels.mode,
        software=detect_software(device),
        # The CPU's default kernels do not split attention by a fixed size; 0 says so.
        batching=batching_policy(
            settings.max_batch_size,
            settings.max_step_tokens,
            getattr(kernels, "kv_split_size", 0),
            settings.expert_routing.describe() if config.moe is not None else None,
            prefix_cache=settings.prefix_cache,
            speculative_tokens=settings.speculative_tokens,
            tensor_parallel=settings.tensor_parallel,
            reduction_tree=reduction_tree(config) if settings.tensor_parallel is not None else None,
        ),
        embedding=embedding_method(settings.pooling),
    )
    pieces = TokenPieces(lambda ids: tokenizer.decode(ids, skip_special_tokens=False), tokenizer.id_to_token)
    pooling = Pooling(
        method=settings.pooling,
        chunk_tokens=settings.max_step_tokens,
        block_size=settings.block_size,
        usable_blocks=num_blocks - (engine_config.step_graphs > 0),  # the step graphs keep one block
        max_len=config.max_position_embeddings,
    )
    return Runtime(
        settings,
        tokenizer,
        engine,
        EngineRunner(engine),
        stack,
        config.max_position_embeddings,
        pieces,
        model,
        pooling,
        GrammarCompiler(tokenizer, config.vocab_size, tokenizer.eos_token_ids),
    )


def kernels_for(
    settings: BackendSettings, config: ModelConfig, device: torch.device, report: Report = lambda _: None
) -> tuple[Kernels, PlanFile | None]:
    """The kernels the settings ask for on `device`, and on a GPU in batch_invariant mode the plan file chosen by
    the whole model's weight shapes (every tensor-parallel rank chooses the same; under "tune", the first rank to
    load tunes, and the others find its file)."""
    plan_file = None
    if device.type == "cuda" and settings.kernel_mode == "batch_invariant":
        from pinned_backend.kernels.triton.plan_files import plan_file_for, running_on

        shapes = matmul_shapes(config)
        if settings.matmul_plans == "tune":
            from pinned_backend.tune import DEFAULT_PLAN_CACHE, plans_at_load

            cache = settings.plan_cache or DEFAULT_PLAN_CACHE
            plan_file = plans_at_load(running_on(device), settings.served_name, shapes, cache, report)
        else:
            plan_file = plan_file_for(running_on(device), set(shapes.values()), settings.matmul_plans)
    kernels = select_kernels(
        settings.kernel_mode, device, kv_split_size=settings.kv_split_size, matmul_plans=plan_file
    )
    return kernels, plan_file


def _kv_budget(settings: BackendSettings, config: ModelConfig, device: torch.device, report: Report) -> int:
    """The KV cache's bytes: as configured, or sized from the model and what the machine has left once the
    weights are loaded (said, so that an operator sees what "auto" chose)."""
    if settings.kv_cache_mb != "auto":
        return int(settings.kv_cache_mb * 2**20)
    available = available_bytes(device)
    budget = automatic_budget(config, settings.torch_dtype, available)
    per_token = PagedKVCache.bytes_per_block(config, 1, settings.torch_dtype)
    report(
        f"KV cache: {budget // per_token} tokens ({budget / 2**20:.1f} MB), for {KV_CONTEXTS} contexts of "
        f"{config.max_position_embeddings} tokens within {KV_MEMORY_SHARE:.0%} of the {available / 2**20:.0f} MB "
        "available (--kv-cache-mb sets it)"
    )
    return budget
