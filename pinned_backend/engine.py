"""The scheduler: continuous batching of many requests over one model and one paged KV cache.

Every call to `Engine.step()` runs one forward pass over a batch built afresh: requests join as soon as
their KV blocks fit and leave the moment they finish, decode tokens of running requests and prefill chunks
of new ones share the step under a per-step token budget (`max_step_tokens`), and each sampled token goes
straight to the request's sink. A request reserves the KV blocks for its prompt plus `max_tokens` when it
joins, so a running request never runs out of cache and the engine never has to evict. The waiting queue is
bounded; `submit` raises `QueueFull` beyond it.

`EngineRunner` (runner.py) runs the step loop in one worker thread, so an asyncio server stays responsive;
tests drive `Engine.step()` directly for a deterministic schedule. The engine knows nothing of HTTP or of
text beyond the `detokenize` function it is given for stop strings; what makes its answers independent of
the batch is the kernels' business and the sampler's, not the schedule's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pinned_backend.kvcache import block_table
from pinned_backend.sampling import SamplingParams, sample_token, top_logprobs_rows
from pinned_backend.step_graphs import StepGraphs
from pinned_backend.textstream import StopTextStream


class EngineError(Exception):
    """Base of the engine's errors."""


class QueueFull(EngineError):
    """The waiting queue holds `max_queue` requests already."""


class RequestTooLarge(EngineError):
    """The request could never be served: longer than the context or than the whole KV cache."""


class EngineStopped(EngineError):
    """The engine shut down before the request finished."""


class Model(Protocol):
    def forward(
        self,
        token_ids: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        block_tables: torch.Tensor,
        cache: Any,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor: ...


class Allocator(Protocol):
    free_blocks: int

    def allocate(self, n: int) -> list[int]: ...

    def free(self, blocks: list[int]) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    num_blocks: int
    block_size: int
    max_batch_size: int = 16
    max_step_tokens: int = 256
    max_queue: int = 64
    eos_token_ids: frozenset[int] = frozenset()
    # Above 0: run every step padded to a few captured shapes, as CUDA graphs on a GPU (step_graphs.py), keeping
    # this many graphs at most (the least recently used dropped first). Only sound under batch-invariant kernels;
    # it reserves one cache block for the padding tokens. 0: run each step as it comes.
    step_graphs: int = 0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_queue < 0 or self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("max_batch_size, num_blocks and block_size must be >= 1 and max_queue >= 0")
        if isinstance(self.step_graphs, bool) or self.step_graphs < 0:
            raise ValueError(f"step_graphs is how many graphs to keep, 0 or more, not {self.step_graphs!r}")
        if self.max_step_tokens < self.max_batch_size:
            # Every running request decodes one token per step, so the budget must cover a full batch.
            raise ValueError(
                f"max_step_tokens ({self.max_step_tokens}) must be >= max_batch_size ({self.max_batch_size})"
            )


@dataclass(frozen=True)
class BatchStats:
    """Over the steps a request took part in: the most and fewest sequences in a step, and how many steps."""

    max: int = 0
    min: int = 0
    steps: int = 0

    def add(self, size: int) -> BatchStats:
        if self.steps == 0:
            return BatchStats(size, size, 1)
        return BatchStats(max(self.max, size), min(self.min, size), self.steps + 1)


@dataclass(frozen=True)
class TokenOutput:
    """One sampled token of a request and the text it releases (held while it may begin a stop string)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    text: str
    finish_reason: str | None
    batch: BatchStats


Sink = Callable[[TokenOutput | EngineError], None]


@dataclass(frozen=True)
class _Drawn:
    """What one sampling row of a step drew."""

    token: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class StepStats:
    seconds: float
    sequences: int
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    kv_used_ratio: float
    # How the step's forward pass ran (step_graphs.StepLaunch) and the tokens it computed only as padding (padding
    # sequences and their logits rows are not counted).
    launch: str = "eager"
    padded_tokens: int = 0


@dataclass(eq=False)
class _Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    text: StopTextStream
    blocks: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are in the cache
    batch: BatchStats = BatchStats()

    def token(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class Engine:
    def __init__(
        self,
        model: Model,
        cache: Any,
        allocator: Allocator,
        kernels: Any,
        config: EngineConfig,
        detokenize: Callable[[Sequence[int]], str],
        device: torch.device | str = "cpu",
        on_step: Callable[[StepStats], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model, self.cache, self.allocator, self.kernels = model, cache, allocator, kernels
        self.config, self.detokenize, self.device = config, detokenize, torch.device(device)
        self.on_step, self.clock = on_step, clock
        self._lock = threading.Lock()  # guards _incoming and _cancelled, the only state other threads touch
        self._incoming: deque[_Sequence] = deque()
        self._cancelled: set[str] = set()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._graphs: StepGraphs | None = None
        if config.step_graphs:
            if getattr(kernels, "mode", None) != "batch_invariant":
                raise ValueError("step graphs pad steps, which only batch-invariant kernels allow")
            self._graphs = StepGraphs(
                model,
                cache,
                scratch_block=allocator.allocate(1)[0],
                max_batch=config.max_batch_size,
                max_tokens=config.max_step_tokens,
                table_width=-(-config.max_model_len // config.block_size),
                device=self.device,
                capture=self.device.type == "cuda",
                max_graphs=config.step_graphs,
            )

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        return -(-(prompt_len + max_tokens) // self.config.block_size)

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink) -> None:
        """Queue a request; thread-safe. Raises `RequestTooLarge` or `QueueFull` instead of queueing."""
        if not prompt_ids:
            raise RequestTooLarge("the prompt has no tokens")
        if len(prompt_ids) + params.max_tokens > self.config.max_model_len:
            raise RequestTooLarge(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length of {self.config.max_model_len} tokens"
            )
        usable = self._usable_blocks
        if self.blocks_needed(len(prompt_ids), params.max_tokens) > usable:
            raise RequestTooLarge(
                f"prompt plus max_tokens needs more KV cache than this server has "
                f"({usable * self.config.block_size} tokens); lower max_tokens"
            )
        seq = _Sequence(request_id, list(prompt_ids), params, sink, StopTextStream(params.stop))
        with self._lock:
            if len(self._incoming) + len(self._waiting) >= self.config.max_queue:
                raise QueueFull(f"the server's queue is full ({self.config.max_queue} waiting); retry later")
            self._incoming.append(seq)

    def cancel(self, request_id: str) -> None:
        """Drop a request wherever it is, at the start of the next step; thread-safe."""
        with self._lock:
            self._cancelled.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._incoming or self._waiting or self._running or self._cancelled)

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._incoming) + len(self._waiting)

    def step(self) -> int:
        """Run one forward pass over the current batch; returns how many sequences took part."""
        start = self.clock()
        self._take_incoming()
        self._admit()
        if not self._running:
            # Nothing to run (the last requests were cancelled): the gauges still learn it.
            self._report(StepStats(0.0, 0, 0, 0, 0, self.queue_depth, self._kv_used()))
            return 0
        plan = self._plan()
        prefill = sum(n for seq, n in plan if seq.computed < len(seq.prompt_ids))
        decode = sum(n for _, n in plan) - prefill
        with torch.inference_mode():
            drawn = self._forward(plan)
        sequences = len(plan)
        for seq, _ in plan:
            seq.batch = seq.batch.add(sequences)
        finished = self._emit(plan, drawn)
        for seq in finished:
            self._release(seq)
        self._report(
            StepStats(
                seconds=self.clock() - start,
                sequences=sequences,
                prefill_tokens=prefill,
                decode_tokens=decode,
                running=len(self._running),
                waiting=self.queue_depth,
                kv_used_ratio=self._kv_used(),
                launch=self._graphs.last_launch if self._graphs is not None else "eager",
                padded_tokens=self._graphs.last_padding if self._graphs is not None else 0,
            )
        )
        return sequences

    def _report(self, stats: StepStats) -> None:
        if self.on_step is not None:
            self.on_step(stats)

    def _kv_used(self) -> float:
        # Of the blocks requests may hold: the padding tokens' block is never theirs.
        return 1 - self.allocator.free_blocks / self._usable_blocks

    @property
    def _usable_blocks(self) -> int:
        return self.config.num_blocks - (self._graphs is not None)

    def abort_all(self, error: EngineError) -> None:
        """Fail every request the engine holds; used when a step raised or the engine stops."""
        with self._lock:
            pending = [*self._incoming, *self._waiting]
            self._incoming.clear()
        self._waiting.clear()
        for seq in [*self._running]:
            self._release(seq)
            pending.append(seq)
        for seq in pending:
            seq.sink(error)

    def _take_incoming(self) -> None:
        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
            cancelled, self._cancelled = self._cancelled, set()
        if cancelled:
            self._waiting = deque(s for s in self._waiting if s.request_id not in cancelled)
            for seq in [s for s in self._running if s.request_id in cancelled]:
                self._release(seq)

    def _admit(self) -> None:
        # First come, first served: a large request at the head waits for room rather than being overtaken.
        while self._waiting and len(self._running) < self.config.max_batch_size:
            seq = self._waiting[0]
            needed = self.blocks_needed(len(seq.prompt_ids), seq.params.max_tokens)
            if needed > self.allocator.free_blocks:
                break
            seq.blocks = self.allocator.allocate(needed)
            self._running.append(self._waiting.popleft())

    def _plan(self) -> list[tuple[_Sequence, int]]:
        """How many tokens each sequence feeds this step: every decode first, then prefill chunks in order."""
        budget = self.config.max_step_tokens
        plan: list[tuple[_Sequence, int]] = []
        for seq in self._running:
            if seq.computed >= len(seq.prompt_ids):
                plan.append((seq, 1))
                budget -= 1
        for seq in self._running:
            if seq.computed < len(seq.prompt_ids) and budget > 0:
                chunk = min(len(seq.prompt_ids) - seq.computed, budget)
                plan.append((seq, chunk))
                budget -= chunk
        return plan

    def _forward(self, plan: list[tuple[_Sequence, int]]) -> dict[int, _Drawn]:
        """Feed the plan's tokens; returns what each plan row that samples a token drew."""
        token_ids: list[int] = []
        query_seq: list[int] = []
        query_pos: list[int] = []
        logits_rows: list[int] = []
        sampling_rows: list[int] = []
        for row, (seq, n) in enumerate(plan):
            for pos in range(seq.computed, seq.computed + n):
                token_ids.append(seq.token(pos))
                query_seq.append(row)
                query_pos.append(pos)
            if seq.computed + n == seq.length:
                logits_rows.append(len(token_ids) - 1)
                sampling_rows.append(row)
        blocks = [seq.blocks for seq, _ in plan]
        if self._graphs is not None:
            logits = self._graphs.forward(token_ids, query_seq, query_pos, blocks, logits_rows)
        else:
            logits = self._eager_forward(token_ids, query_seq, query_pos, blocks, logits_rows)
        for seq, n in plan:
            seq.computed += n
        if not sampling_rows:
            return {}
        return self._sample(logits, [plan[row][0] for row in sampling_rows], sampling_rows)

    def _eager_forward(
        self,
        token_ids: list[int],
        query_seq: list[int],
        query_pos: list[int],
        blocks: list[list[int]],
        logits_rows: list[int],
    ) -> torch.Tensor:
        tables = block_table(blocks, len(blocks), max(len(owned) for owned in blocks))
        dev = self.device
        return self.model.forward(
            torch.tensor(token_ids, dtype=torch.int64, device=dev),
            torch.tensor(query_seq, dtype=torch.int32, device=dev),
            torch.tensor(query_pos, dtype=torch.int32, device=dev),
            tables.to(dev),
            self.cache,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )

    def _sample(self, logits: torch.Tensor, seqs: list[_Sequence], plan_rows: list[int]) -> dict[int, _Drawn]:
        """Each sampling row's token, its log-probability and the top log-probabilities asked for.

        Greedy rows take the argmax where the logits are (torch.argmax returns the first of equal maxima on
        every device, as `sample_token` does), so a GPU step moves a few numbers to the host, not whole rows of
        the vocabulary; only rows that draw at random bring their logits to the CPU's float64 sampler."""
        logprobs = self.kernels.log_softmax(logits).float()  # [R, V]
        tokens = torch.argmax(logits, dim=-1).tolist()
        drawn = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if drawn:
            host = logits[torch.tensor(drawn, device=logits.device)].float().cpu()
            for j, i in enumerate(drawn):
                tokens[i] = sample_token(host[j], seqs[i].params, len(seqs[i].output_ids))
        index = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        chosen = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
        tops = top_logprobs_rows(logprobs, [seq.params.top_logprobs for seq in seqs])
        return {row: _Drawn(tokens[i], chosen[i], tops[i]) for i, row in enumerate(plan_rows)}

    def _emit(self, plan: list[tuple[_Sequence, int]], rows: dict[int, _Drawn]) -> list[_Sequence]:
        finished = []
        for row, (seq, _) in enumerate(plan):
            if row not in rows:
                continue
            draw = rows[row]
            token = draw.token
            seq.output_ids.append(token)
            reason = self._finish_reason(seq, token)
            if token in self.config.eos_token_ids:
                text = seq.text.finish()
            else:
                text = seq.text.update(self.detokenize(seq.output_ids))
                if seq.text.stopped:
                    reason = "stop"
                elif reason is not None:
                    text += seq.text.finish()
            seq.sink(
                TokenOutput(
                    token_id=token,
                    logprob=draw.logprob,
                    top_logprobs=draw.top_logprobs,
                    text=text,
                    finish_reason=reason,
                    batch=seq.batch,
                )
            )
            if reason is not None:
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        if token in self.config.eos_token_ids:
            return "stop"
        if len(seq.output_ids) >= seq.params.max_tokens or seq.length >= self.config.max_model_len:
            return "length"
        return None

    def _release(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        self.allocator.free(seq.blocks)
        seq.blocks = []
