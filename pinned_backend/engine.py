"""The scheduler: continuous batching of many requests over one model and one paged KV cache, with a prefix cache
and speculative decoding by prompt lookup.

Every call to `Engine.step()` runs one forward pass over a batch built afresh: requests join as soon as
their KV blocks fit and leave the moment they finish, decode tokens of running requests and prefill chunks
of new ones share the step under a per-step token budget (`max_step_tokens`), and each sampled token goes
straight to the request's sink. A request reserves the KV blocks for its prompt plus `max_tokens` when it
joins, so a running request never runs out of cache and the engine never has to evict. The waiting queue is
bounded; `submit` raises `QueueFull` beyond it.

Prefix cache (`prefix_cache`). When a request joins, the full blocks of its prompt (all of it but the last token,
whose logits must be computed) are looked up by content in the allocator (kvcache.py); the longest run found is
shared, and prefill starts after it, in chunks as any other. Each block that steps fill with computed tokens,
prompt or output, is published under its key for the requests after it.

Speculative decoding (`speculative_tokens` = k > 0). A decoding request feeds, after its last token, up to k draft
tokens from prompt lookup (speculation.py) in the same step, with logits at each. The token at each position is
drawn exactly as a plain decode step would draw it (the argmax, or the seeded sampler at that position of the
completion); drafts are kept while each is the token drawn before it, and the first draw that differs (or the one
after the last draft) is emitted too: 1 to k + 1 tokens a step. Keys and values written for rejected drafts lie
past the sequence's end, where no query looks, until the real tokens overwrite them.

Grammars (`SamplingParams.grammar`, grammar.py). A constrained request's sequence follows its own matcher: the rows
it draws from are masked to the tokens its grammar allows (masks.py, computed while the forward pass runs), its
drafts are only those the grammar allows, and every token it emits is committed; when the grammar allows nothing
more, it finishes with `stop`. A mask is a function of the sequence's own tokens, so it brings no dependence on the
batch, a hit or a verify pass into the answer.

Why neither changes a bit under batch-invariant kernels. A row's result depends on its own inputs alone: every
matmul row's reduction order is fixed whatever M, norms and softmax reduce each row alone, and attention walks a
query's keys 0..p in splits of `kv_split_size` counted from position 0 of its sequence, merged in split order. So:
- the keys and values at position p are a function of tokens 0..p alone, whichever step computed them, in
  whichever chunk, amid whichever neighbours: a cached block holds the bits a cold prefill writes;
- a query after a hit meets the same splits over the same key bits as cold, so prefill may start at any block
  boundary and be cut anywhere: where the chunks fall moves with a hit and never matters;
- a verify pass is a short chunk of one sequence: its row i (position L - 1 + i) sees keys 0..L - 1 + i, which,
  while the drafts before it are accepted, hold the tokens plain decoding would have fed, so its logits are that
  decode step's bits; rows after a rejected draft are dropped;
- the sampler takes its randomness from a hash of (seed, position in the completion) (sampling.py), never from a
  stream consumed call by call, so a position's token is the same whichever step computes its logits.
Where it could still leak, and why it does not: splits counted from the chunk or the hit rather than position 0
(they are not, on either device); keys a rejected draft left past the end (attention masks every key past a
query's position, and a masked key adds exactly 0); a block published before its positions hold their final
tokens (a block is published only once `computed`, which counts accepted tokens alone, has passed its end); a
step writing into a shared block (a hit ends before the prompt's last token, on a block boundary, so every write
lands in a block of the request's own); a sampler whose state advances per draw (it has none). Under `default`
kernels a hit or a verify pass changes the shapes a row's reductions meet, and so its bits:
tests/test_invariance.py reports how often.

`EngineRunner` (runner.py) runs the step loop in one worker thread, so an asyncio server stays responsive;
tests drive `Engine.step()` directly for a deterministic schedule. The engine knows nothing of HTTP or of
text beyond the `detokenize` function it is given for stop strings; what makes its answers independent of
the batch is the kernels' business and the sampler's, not the schedule's.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import torch

from pinned_backend.grammar import GrammarState, Matcher
from pinned_backend.kvcache import ROOT_KEY, block_key, block_keys, block_table
from pinned_backend.masks import MaskRows, StepMasks
from pinned_backend.sampling import Drawn, RowRun, SamplingParams, draw_runs
from pinned_backend.speculation import PromptLookup
from pinned_backend.step_graphs import StepGraphs
from pinned_backend.textstream import StopTextStream


class EngineError(Exception):
    """Base of the engine's errors."""


class QueueFull(EngineError):
    """The waiting queue holds `max_queue` requests already."""


class RequestTooLarge(EngineError):
    """The request could never be served: longer than the context or than the whole KV cache. `param` names what
    makes it so: the `prompt` (too long even for one token of answer) or `max_tokens` (lowering it would do)."""

    def __init__(self, message: str, param: Literal["prompt", "max_tokens"] = "prompt") -> None:
        super().__init__(message)
        self.param = param


# What a request too large for the KV cache is told to change on the server's side.
KV_CACHE_SETTING = "the server's KV cache (stackpin-backend serve --kv-cache-mb; [local_backend] kv_cache_mb)"


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

    def lookup(self, keys: Sequence[bytes]) -> list[int]: ...

    def publish(self, block: int, key: bytes) -> bool: ...


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
    # this many graphs at most (the least recently used dropped first). Under batch-invariant kernels padding
    # changes no bit; under default kernels it may, as the batch does. It reserves one cache block for the padding
    # tokens. 0: run each step as it comes.
    step_graphs: int = 0
    # Share cached KV blocks between requests whose prompts start alike (kvcache.py).
    prefix_cache: bool = False
    # Draft tokens a decoding request may verify in one step (prompt lookup); 0 turns speculation off.
    speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_queue < 0 or self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("max_batch_size, num_blocks and block_size must be >= 1 and max_queue >= 0")
        for name in ("step_graphs", "speculative_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} is a count, 0 or more, not {value!r}")
        if self.max_step_tokens < self.max_batch_size:
            # Every running request decodes one token per step, so the budget must cover a full batch.
            raise ValueError(
                f"max_step_tokens ({self.max_step_tokens}) must be >= max_batch_size ({self.max_batch_size})"
            )

    @property
    def max_logits_rows(self) -> int:
        """The most tokens of one step that need logits: each sequence's last, and its drafts'."""
        return min(self.max_step_tokens, self.max_batch_size * (1 + self.speculative_tokens))


@dataclass(frozen=True)
class BatchStats:
    """Over the steps a request took part in: the most and fewest sequences in a step, and how many steps; how many
    of its prompt tokens came from the prefix cache, and how many of its tokens were drafts accepted."""

    max: int = 0
    min: int = 0
    steps: int = 0
    cached_tokens: int = 0
    accepted_draft_tokens: int = 0

    def add(self, size: int) -> BatchStats:
        if self.steps == 0:
            return replace(self, max=size, min=size, steps=1)
        return replace(self, max=max(self.max, size), min=min(self.min, size), steps=self.steps + 1)


@dataclass(frozen=True)
class TokenOutput:
    """One sampled token of a request and the text it releases (held while it may begin a stop string)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    text: str
    finish_reason: str | None
    batch: BatchStats
    grammar: GrammarState | None = None  # a constrained request's matcher after this token


Sink = Callable[[TokenOutput | EngineError], None]


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
    # Prompt tokens of the requests that joined this step found in the prefix cache (not computed, not counted in
    # prefill_tokens); draft tokens fed (counted in decode_tokens) and how many of them were kept.
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Seconds the step spent on grammars after its forward pass: waiting for masks not yet done, and applying them.
    grammar_seconds: float = 0.0


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
    prompt_keys: list[bytes] | None = None  # the keys of the prompt's full blocks before its last token
    keys: list[bytes] = field(default_factory=list)  # the keys of the blocks published (or found) so far
    lookup: PromptLookup | None = None
    drafts: list[int] = field(default_factory=list)  # this step's draft tokens
    matcher: Matcher | None = None  # where the output stands in its grammar, for a constrained request

    def token(self, index: int) -> int:
        n = len(self.prompt_ids)
        if index < n:
            return self.prompt_ids[index]
        if index < self.length:
            return self.output_ids[index - n]
        return self.drafts[index - self.length]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt_ids)


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
        self._masks = StepMasks()
        self._grammar_seconds = 0.0  # this step's, for StepStats
        self._graphs: StepGraphs | None = None
        if config.step_graphs:
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
                max_rows=config.max_logits_rows,
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
                f"context length of {self.config.max_model_len} tokens",
                "max_tokens",
            )
        self._check_fits_cache(len(prompt_ids), params.max_tokens)
        seq = _Sequence(request_id, list(prompt_ids), params, sink, StopTextStream(params.stop))
        if params.grammar is not None:
            seq.matcher = params.grammar.matcher()
        with self._lock:
            if len(self._incoming) + len(self._waiting) >= self.config.max_queue:
                raise QueueFull(f"the server's queue is full ({self.config.max_queue} waiting); retry later")
            self._incoming.append(seq)

    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens, prompt and answer, that one request can hold in the KV cache."""
        return self._usable_blocks * self.config.block_size

    def _check_fits_cache(self, prompt_len: int, max_tokens: int) -> None:
        usable, capacity = self._usable_blocks, self.kv_capacity_tokens
        if self.blocks_needed(prompt_len, 1) > usable:
            raise RequestTooLarge(
                f"the prompt ({prompt_len} tokens) does not fit in the KV cache, which holds {capacity} tokens of "
                f"prompt and answer: shorten the prompt, or enlarge {KV_CACHE_SETTING}"
            )
        if self.blocks_needed(prompt_len, max_tokens) > usable:
            raise RequestTooLarge(
                f"the prompt ({prompt_len} tokens) and max_tokens ({max_tokens}) need more than the {capacity} "
                f"tokens the KV cache holds: lower max_tokens to at most {capacity - prompt_len}, or enlarge "
                f"{KV_CACHE_SETTING}",
                "max_tokens",
            )

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
        cached = self._admit()
        if not self._running:
            # Nothing to run (the last requests were cancelled): the gauges still learn it.
            self._report(StepStats(0.0, 0, 0, 0, 0, self.queue_depth, self._kv_used()))
            return 0
        plan = self._plan()
        self._grammar_seconds = 0.0
        prefill = sum(n for seq, n in plan if seq.prefilling)
        drafts = sum(len(seq.drafts) for seq, _ in plan)
        with torch.inference_mode():
            drawn = self._forward(plan)
        sequences = len(plan)
        for seq, _ in plan:
            seq.batch = seq.batch.add(sequences)
        finished, accepted = self._emit(plan, drawn)
        if self.config.prefix_cache:
            for seq, _ in plan:
                self._publish(seq)
        for seq in finished:
            self._release(seq)
        self._report(
            StepStats(
                seconds=self.clock() - start,
                sequences=sequences,
                prefill_tokens=prefill,
                decode_tokens=sum(n for _, n in plan) - prefill,
                running=len(self._running),
                waiting=self.queue_depth,
                kv_used_ratio=self._kv_used(),
                launch=self._graphs.last_launch if self._graphs is not None else "eager",
                padded_tokens=self._graphs.last_padding if self._graphs is not None else 0,
                cached_tokens=cached,
                draft_tokens=drafts,
                accepted_draft_tokens=accepted,
                grammar_seconds=self._grammar_seconds,
            )
        )
        return sequences

    def _report(self, stats: StepStats) -> None:
        if self.on_step is not None:
            self.on_step(stats)

    def _kv_used(self) -> float:
        # Of the blocks requests may hold: the padding tokens' block is never theirs; idle cached blocks are free.
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

    def _admit(self) -> int:
        """Let waiting requests join while their blocks fit; returns the prompt tokens they found cached."""
        # First come, first served: a large request at the head waits for room rather than being overtaken.
        cached = 0
        while self._waiting and len(self._running) < self.config.max_batch_size:
            seq = self._waiting[0]
            if not self._reserve(seq):
                break
            cached += seq.computed
            self._running.append(self._waiting.popleft())
        return cached

    def _reserve(self, seq: _Sequence) -> bool:
        """Give `seq` its blocks, the cached prefix of its prompt shared, or leave everything as it was."""
        size = self.config.block_size
        hit: list[int] = []
        if self.config.prefix_cache:
            if seq.prompt_keys is None:
                # The last prompt token is always computed, for its logits, in a block of the request's own.
                seq.prompt_keys = block_keys(seq.prompt_ids[:-1], size)
            hit = self.allocator.lookup(seq.prompt_keys)
        fresh = self.blocks_needed(len(seq.prompt_ids), seq.params.max_tokens) - len(hit)
        if fresh > self.allocator.free_blocks:
            self.allocator.free(hit)
            return False
        seq.blocks = hit + self.allocator.allocate(fresh)
        seq.keys = list(seq.prompt_keys[: len(hit)]) if hit and seq.prompt_keys else []
        seq.computed = len(hit) * size
        seq.batch = replace(seq.batch, cached_tokens=seq.computed)
        return True

    def _plan(self) -> list[tuple[_Sequence, int]]:
        """How many tokens each sequence feeds this step: every decode first, then drafts, then prefill chunks."""
        budget = self.config.max_step_tokens
        decoding = [seq for seq in self._running if not seq.prefilling]
        budget -= len(decoding)
        for seq in decoding:
            seq.drafts = self._drafts(seq, budget)
            budget -= len(seq.drafts)
        plan = [(seq, 1 + len(seq.drafts)) for seq in decoding]
        for seq in self._running:
            if seq.prefilling and budget > 0:
                chunk = min(len(seq.prompt_ids) - seq.computed, budget)
                plan.append((seq, chunk))
                budget -= chunk
        return plan

    def _drafts(self, seq: _Sequence, budget: int) -> list[int]:
        # Never past max_tokens: the last token drawn is one more than the drafts, and its keys stay unwritten.
        k = min(self.config.speculative_tokens, budget, seq.params.max_tokens - len(seq.output_ids) - 1)
        if k <= 0:
            return []
        if seq.lookup is None:
            seq.lookup = PromptLookup([*seq.prompt_ids, *seq.output_ids])
        drafts = seq.lookup.draft(k)
        if seq.matcher is not None:
            # Only drafts the grammar allows, so that each row after one has a mask; an end-of-sequence token
            # ends the output, so nothing after it is worth verifying (and the row at it draws it anyway).
            drafts = drafts[: seq.matcher.valid_prefix(drafts)]
            drafts = list(itertools.takewhile(lambda t: t not in self.config.eos_token_ids, drafts))
        return drafts

    def _forward(self, plan: list[tuple[_Sequence, int]]) -> dict[int, list[Drawn]]:
        """Feed the plan's tokens; returns what each plan row that samples drew, in order: one token, or for a
        verify pass its accepted drafts and the token drawn after them."""
        token_ids: list[int] = []
        query_seq: list[int] = []
        query_pos: list[int] = []
        logits_rows: list[int] = []
        sampling: list[tuple[int, int, int]] = []  # (plan row, its first logits row, how many)
        for row, (seq, n) in enumerate(plan):
            first = len(logits_rows)
            for pos in range(seq.computed, seq.computed + n):
                token_ids.append(seq.token(pos))
                query_seq.append(row)
                query_pos.append(pos)
                if pos >= seq.length - 1:  # the last token and each draft: a position to draw at
                    logits_rows.append(len(token_ids) - 1)
            if len(logits_rows) > first:
                sampling.append((row, first, len(logits_rows) - first))
        # The masks depend only on tokens already known: they are computed while the forward pass runs.
        drawing = [(plan[row][0].matcher, first, plan[row][0].drafts) for row, first, _ in sampling]
        masks = self._masks.start(
            [MaskRows(matcher, first, drafts) for matcher, first, drafts in drawing if matcher is not None],
            len(logits_rows),
        )
        blocks = [seq.blocks for seq, _ in plan]
        if self._graphs is not None:
            logits = self._graphs.forward(token_ids, query_seq, query_pos, blocks, logits_rows)
        else:
            logits = self._eager_forward(token_ids, query_seq, query_pos, blocks, logits_rows)
        for seq, n in plan:
            seq.computed += n  # drafts included: _emit takes back the rejected ones
        if not sampling:
            return {}
        if masks is not None:
            started = self.clock()
            logits = masks.apply(logits)
            self._grammar_seconds = self.clock() - started
        return self._sample(logits, [(plan[row][0], row, first, n) for row, first, n in sampling])

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

    def _sample(
        self, logits: torch.Tensor, rows: list[tuple[_Sequence, int, int, int]]
    ) -> dict[int, list[Drawn]]:
        """What each sampling sequence draws at its logits rows (sampling.draw_runs): one token, or a verify pass's
        accepted drafts and the token drawn after them."""
        runs = [RowRun(seq.params, len(seq.output_ids), first, n, seq.drafts) for seq, _, first, n in rows]
        drawn = draw_runs(logits, runs, self.kernels.log_softmax)
        return {plan_row: draws for (_, plan_row, _, _), draws in zip(rows, drawn, strict=True)}

    def _emit(
        self, plan: list[tuple[_Sequence, int]], rows: dict[int, list[Drawn]]
    ) -> tuple[list[_Sequence], int]:
        """Send each drawn token to its sink, stopping at a finish; (the sequences finished, drafts accepted)."""
        finished = []
        accepted = 0
        for row, (seq, _) in enumerate(plan):
            draws = rows.get(row, [])
            for i, draw in enumerate(draws):
                if i < len(draws) - 1:  # a draw followed by another was the draft there: it was kept
                    accepted += 1
                    seq.batch = replace(seq.batch, accepted_draft_tokens=seq.batch.accepted_draft_tokens + 1)
                if self._emit_token(seq, draw):
                    finished.append(seq)
                    break
            # The keys of the tokens drawn after the last accepted draft are not computed yet.
            seq.computed = min(seq.computed, seq.length - 1)
            seq.drafts = []
        return finished, accepted

    def _emit_token(self, seq: _Sequence, draw: Drawn) -> bool:
        """Append one drawn token and send it; True when it finishes the request."""
        token = draw.token
        seq.output_ids.append(token)
        if seq.lookup is not None:
            seq.lookup.append(token)
        reason = self._finish_reason(seq, token)
        if seq.matcher is not None and token not in self.config.eos_token_ids:
            seq.matcher.commit(token)
            if seq.matcher.stopped:  # the grammar allows nothing more: the output is complete
                reason = "stop"
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
                grammar=None if seq.matcher is None else seq.matcher.state(final=reason is not None),
            )
        )
        return reason is not None

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        if token in self.config.eos_token_ids:
            return "stop"
        if len(seq.output_ids) >= seq.params.max_tokens or seq.length >= self.config.max_model_len:
            return "length"
        return None

    def _publish(self, seq: _Sequence) -> None:
        """Offer each block the sequence has filled with computed tokens since the last step to the prefix cache."""
        size = self.config.block_size
        while (len(seq.keys) + 1) * size <= seq.computed:
            i = len(seq.keys)
            key = block_key(
                seq.keys[-1] if seq.keys else ROOT_KEY,
                [seq.token(p) for p in range(i * size, (i + 1) * size)],
            )
            self.allocator.publish(seq.blocks[i], key)
            seq.keys.append(key)

    def _release(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        self.allocator.free(seq.blocks)
        seq.blocks = []
