"""Specification of pinned_backend.engine: continuous batching, chunked prefill, KV budget, bounds, stops."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pinned_backend.engine import (
    Engine,
    EngineConfig,
    QueueFull,
    RequestTooLarge,
    StepStats,
    TokenOutput,
)
from pinned_backend.kernels.cpu_default import TorchKernels
from pinned_backend.kvcache import BlockAllocator
from pinned_backend.sampling import SamplingParams
from tests.support.backend_checkpoint import Collector, letters, write_random_checkpoint
from tests.support.backend_checkpoint import make_engine as make_checkpoint_engine

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("engine") / "random-qwen3")


@pytest.fixture
def make_engine(checkpoint: Path) -> Callable[..., Engine]:
    def make(stats: list[StepStats] | None = None, **overrides: Any) -> Engine:
        fields: dict[str, Any] = {
            "num_blocks": 32,
            "block_size": 4,
            "max_batch_size": 4,
            "max_step_tokens": 8,
            "max_queue": 8,
        }
        on_step = None if stats is None else stats.append
        return make_checkpoint_engine(checkpoint, **{**fields, **overrides}, on_step=on_step)

    return make


def run_until_idle(engine: Engine, limit: int = 500) -> None:
    for _ in range(limit):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not finish its work")


def test_a_request_gets_max_tokens_tokens_and_finishes_with_length(
    make_engine: Callable[..., Engine],
) -> None:
    engine, out = make_engine(), Collector()
    engine.submit("a", [1, 2, 3], GREEDY, out)
    run_until_idle(engine)
    assert len(out.tokens) == 6
    assert [o.finish_reason for o in out.outputs] == [None] * 5 + ["length"]
    assert all(o.logprob <= 0 for o in out.outputs)
    assert out.text == letters(out.tokens)


def test_requests_join_and_leave_the_running_batch_at_every_step(make_engine: Callable[..., Engine]) -> None:
    stats: list[StepStats] = []
    engine, first, second = make_engine(stats), Collector(), Collector()
    engine.submit("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=10), first)
    engine.step()
    engine.step()
    engine.submit("b", [4, 5], SamplingParams(temperature=0, max_tokens=2), second)
    run_until_idle(engine)
    assert [s.sequences for s in stats[:6]] == [1, 1, 2, 2, 1, 1]
    assert second.outputs[-1].batch.max == 2
    assert (first.outputs[-1].batch.max, first.outputs[-1].batch.min) == (2, 1)
    assert first.outputs[-1].batch.steps == 10


def test_prefill_is_chunked_by_the_step_budget_and_shares_steps_with_decode(
    make_engine: Callable[..., Engine],
) -> None:
    stats: list[StepStats] = []
    engine = make_engine(stats, max_step_tokens=8)
    engine.submit("a", [1, 2], SamplingParams(temperature=0, max_tokens=8), Collector())
    engine.step()
    engine.submit("b", list(range(20)), GREEDY, Collector())
    run_until_idle(engine)
    assert all(s.prefill_tokens + s.decode_tokens <= 8 for s in stats)
    assert [s.prefill_tokens for s in stats[1:4]] == [7, 7, 6]
    assert all(s.decode_tokens == 1 for s in stats[1:4])


def test_chunked_prefill_gives_the_same_tokens_as_one_piece(make_engine: Callable[..., Engine]) -> None:
    prompt = [(7 * i) % 40 for i in range(30)]
    small, large = Collector(), Collector()
    engine = make_engine(max_step_tokens=4)
    engine.submit("a", prompt, GREEDY, small)
    run_until_idle(engine)
    engine = make_engine(max_step_tokens=64)
    engine.submit("a", prompt, GREEDY, large)
    run_until_idle(engine)
    assert small.tokens == large.tokens
    assert [o.logprob for o in small.outputs] == [o.logprob for o in large.outputs]


def test_the_kv_budget_makes_requests_wait_and_every_block_comes_back(
    make_engine: Callable[..., Engine],
) -> None:
    stats: list[StepStats] = []
    # Each request needs (4 + 6) / 4 -> 3 blocks; 5 blocks hold one at a time.
    engine = make_engine(stats, num_blocks=5)
    outs = [Collector() for _ in range(3)]
    for i, out in enumerate(outs):
        engine.submit(str(i), [1, 2, 3, 4], GREEDY, out)
    run_until_idle(engine)
    assert max(s.sequences for s in stats) == 1
    assert all(len(o.tokens) == 6 for o in outs)
    assert engine.allocator.free_blocks == 5
    assert stats[-1].kv_used_ratio == 0


def test_the_waiting_queue_is_bounded(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_queue=2)
    engine.submit("a", [1], GREEDY, Collector())
    engine.submit("b", [1], GREEDY, Collector())
    with pytest.raises(QueueFull, match="queue is full"):
        engine.submit("c", [1], GREEDY, Collector())
    engine.step()  # both join the batch, so the queue has room again
    engine.submit("c", [1], GREEDY, Collector())


def test_requests_that_can_never_fit_are_refused_up_front(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(num_blocks=3)
    with pytest.raises(RequestTooLarge, match="context length of 256"):
        engine.submit("a", [1] * 251, GREEDY, Collector())
    with pytest.raises(RequestTooLarge, match="KV cache"):
        engine.submit("b", list(range(8)), GREEDY, Collector())
    with pytest.raises(RequestTooLarge, match="no tokens"):
        engine.submit("c", [], GREEDY, Collector())


def test_a_request_the_kv_cache_cannot_hold_is_told_whether_its_prompt_or_max_tokens_is_the_cause(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(num_blocks=3)  # 12 tokens of KV cache
    assert engine.kv_capacity_tokens == 12
    with pytest.raises(RequestTooLarge) as prompt:
        engine.submit("long", [1] * 12, SamplingParams(temperature=0, max_tokens=1), Collector())
    assert prompt.value.param == "prompt", "max_tokens=1 is not what makes it too large"
    assert "max_tokens" not in str(prompt.value) and "kv_cache_mb" in str(prompt.value)
    assert "--kv-cache-mb" in str(prompt.value) and "12 tokens" in str(prompt.value)
    with pytest.raises(RequestTooLarge) as answer:
        engine.submit("long", [1] * 8, SamplingParams(temperature=0, max_tokens=6), Collector())
    assert answer.value.param == "max_tokens" and "at most 4" in str(answer.value)
    assert "kv_cache_mb" in str(answer.value)


def test_a_stop_string_cuts_the_text_and_finishes_with_stop(make_engine: Callable[..., Engine]) -> None:
    engine, free = make_engine(), Collector()
    engine.submit("free", [3, 1, 4], SamplingParams(temperature=0, max_tokens=12), free)
    run_until_idle(engine)
    stop = free.text[4:6]
    engine, cut = make_engine(), Collector()
    engine.submit("cut", [3, 1, 4], SamplingParams(temperature=0, max_tokens=12, stop=(stop,)), cut)
    run_until_idle(engine)
    assert cut.outputs[-1].finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.tokens == free.tokens[: len(cut.tokens)]


def test_eos_finishes_with_stop_and_adds_no_text(make_engine: Callable[..., Engine]) -> None:
    engine, free = make_engine(), Collector()
    engine.submit("free", [3, 1, 4], SamplingParams(temperature=0, max_tokens=8), free)
    run_until_idle(engine)
    eos = free.tokens[3]
    engine, out = make_engine(eos_token_ids=frozenset({eos})), Collector()
    engine.submit("eos", [3, 1, 4], SamplingParams(temperature=0, max_tokens=8), out)
    run_until_idle(engine)
    first = free.tokens.index(eos)
    assert out.tokens == free.tokens[: first + 1]
    assert out.outputs[-1].finish_reason == "stop"
    assert out.text == letters(free.tokens[:first])


def test_top_logprobs_come_from_the_same_distribution_as_the_token(
    make_engine: Callable[..., Engine],
) -> None:
    engine, out = make_engine(), Collector()
    engine.submit("a", [5, 6], SamplingParams(temperature=0, max_tokens=3, top_logprobs=4), out)
    run_until_idle(engine)
    for o in out.outputs:
        assert len(o.top_logprobs) == 4
        assert o.top_logprobs[0] == (o.token_id, o.logprob)


def test_cancel_drops_a_request_and_frees_its_blocks(make_engine: Callable[..., Engine]) -> None:
    stats: list[StepStats] = []
    engine, out = make_engine(stats), Collector()
    engine.submit("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50), out)
    engine.step()
    engine.cancel("a")
    run_until_idle(engine)
    assert len(out.tokens) == 1
    assert engine.allocator.free_blocks == 32
    assert (stats[-1].running, stats[-1].kv_used_ratio) == (0, 0)


def test_config_rejects_a_step_budget_smaller_than_the_batch() -> None:
    with pytest.raises(ValueError, match="max_step_tokens"):
        EngineConfig(max_model_len=16, num_blocks=4, block_size=4, max_batch_size=8, max_step_tokens=4)


def test_a_prompt_sharing_a_cached_prefix_is_prefilled_from_where_the_cache_ends(
    make_engine: Callable[..., Engine],
) -> None:
    stats: list[StepStats] = []
    engine, first, second = make_engine(stats, prefix_cache=True), Collector(), Collector()
    prompt = [(5 * i) % 40 for i in range(14)]
    engine.submit("a", prompt, GREEDY, first)
    run_until_idle(engine)
    stats.clear()
    engine.submit("b", [*prompt[:10], 41, 42], GREEDY, second)
    run_until_idle(engine)
    # Blocks of 4: the first two are shared, the third differs from token 10 on.
    assert second.outputs[-1].batch.cached_tokens == 8
    assert stats[0].cached_tokens == 8 and sum(s.prefill_tokens for s in stats) == 4
    assert first.outputs[-1].batch.cached_tokens == 0


def test_a_repeated_prompt_recomputes_its_last_block_only(make_engine: Callable[..., Engine]) -> None:
    stats: list[StepStats] = []
    engine, cold, warm = make_engine(stats, prefix_cache=True), Collector(), Collector()
    prompt = list(range(12))  # three full blocks
    engine.submit("cold", prompt, GREEDY, cold)
    run_until_idle(engine)
    stats.clear()
    engine.submit("warm", prompt, GREEDY, warm)
    run_until_idle(engine)
    # The last token's logits must be computed, so its block is computed afresh and no step writes a shared block.
    assert warm.outputs[-1].batch.cached_tokens == 8 and sum(s.prefill_tokens for s in stats) == 4
    assert warm.tokens == cold.tokens


def test_the_blocks_a_completion_fills_are_cached_for_the_next_turn(
    make_engine: Callable[..., Engine],
) -> None:
    engine, first, second = make_engine(prefix_cache=True), Collector(), Collector()
    prompt = [3, 1, 4, 1, 5, 9]
    engine.submit("a", prompt, SamplingParams(temperature=0, max_tokens=10), first)
    run_until_idle(engine)
    engine.submit("b", prompt + first.tokens + [7], GREEDY, second)
    run_until_idle(engine)
    # 15 of the first turn's 16 tokens have keys and values (the last drawn one never does): three full blocks.
    assert second.outputs[-1].batch.cached_tokens == 12


def test_idle_cached_blocks_give_way_to_requests_that_need_the_room(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(num_blocks=8, prefix_cache=True)
    for i in range(3):
        engine.submit(str(i), [10 * i + t for t in range(8)], GREEDY, Collector())
        run_until_idle(engine)
    assert engine.allocator.cached_blocks > 0 and engine.allocator.free_blocks == 8
    big = Collector()
    engine.submit("big", list(range(50, 76)), GREEDY, big)  # (26 + 6) / 4: every block
    run_until_idle(engine)
    assert len(big.tokens) == 6 and engine.allocator.free_blocks == 8


class SuccessorModel:
    """A stand-in model whose every logits row picks the token after the one fed there, (t + 1) mod 64, with a
    margin of 8: a model that copies runs of consecutive ids, so prompt lookup's drafts are right when the prompt
    holds the run."""

    vocab = 64

    def forward(
        self,
        token_ids: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        block_tables: torch.Tensor,
        cache: Any,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        logits = torch.zeros(len(logits_rows), self.vocab)
        logits[torch.arange(len(logits_rows)), (token_ids[logits_rows] + 1) % self.vocab] = 8.0
        return logits


def successor_engine(stats: list[StepStats], **overrides: Any) -> Engine:
    fields: dict[str, Any] = {"max_model_len": 128, "num_blocks": 32, "block_size": 4, "max_batch_size": 4}
    config = EngineConfig(**{**fields, "max_step_tokens": 16, "speculative_tokens": 4, **overrides})
    return Engine(
        SuccessorModel(), None, BlockAllocator(32), TorchKernels(), config, letters, on_step=stats.append
    )


def test_speculation_emits_the_drafts_the_model_agrees_with_several_a_step() -> None:
    stats: list[StepStats] = []
    engine, out = successor_engine(stats), Collector()
    # After "... 1 2 3" the prompt showed "4 5 6 7": four drafts, all of them what the model draws.
    engine.submit("a", [*range(20), 0, 1, 2], SamplingParams(temperature=0, max_tokens=12), out)
    run_until_idle(engine)
    assert out.tokens == list(range(3, 15))
    # Two steps of prefill, two verify passes of the last token and four drafts, and a last plain step: no draft
    # may reach past max_tokens.
    assert [s.decode_tokens for s in stats] == [0, 0, 5, 5, 1]
    assert [s.accepted_draft_tokens for s in stats] == [0, 0, 4, 4, 0]
    assert out.outputs[-1].batch.accepted_draft_tokens == 8 and out.outputs[-1].batch.steps == 5


def test_a_rejected_draft_ends_the_verify_pass_with_the_token_drawn_instead() -> None:
    stats: list[StepStats] = []
    engine, out = successor_engine(stats), Collector()
    # The prompt continues "5 6 7" with "8 40 2 3": the model draws 8, then 9 where the draft says 40.
    engine.submit("a", [5, 6, 7, 8, 40, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=6), out)
    run_until_idle(engine)
    assert out.tokens == [7, 8, 9, 10, 11, 12]
    assert (stats[1].draft_tokens, stats[1].accepted_draft_tokens) == (4, 1)
    assert [o.batch.steps for o in out.outputs] == [1, 2, 2, 3, 4, 5]


def test_a_stop_inside_a_verify_pass_drops_the_tokens_after_it() -> None:
    stats: list[StepStats] = []
    engine, out = successor_engine(stats, eos_token_ids=frozenset({6})), Collector()
    engine.submit("a", [1, 2, 3, 4, 5, 6, 7, 1, 2], SamplingParams(temperature=0, max_tokens=10), out)
    run_until_idle(engine)
    assert out.tokens == [3, 4, 5, 6] and out.outputs[-1].finish_reason == "stop"
    assert engine.allocator.free_blocks == 32


def test_seeded_sampling_keeps_a_draft_only_when_it_is_the_token_drawn_there() -> None:
    def serve(drafts: int) -> list[TokenOutput]:
        engine, out = successor_engine([], speculative_tokens=drafts), Collector()
        params = SamplingParams(temperature=1.0, seed=11, max_tokens=12)
        engine.submit("a", [*range(20), 0, 1, 2], params, out)
        run_until_idle(engine)
        return out.outputs

    off, on = serve(0), serve(4)
    assert [(o.token_id, o.logprob) for o in on] == [(o.token_id, o.logprob) for o in off]
    assert on[-1].batch.steps < off[-1].batch.steps, "some drafts were kept"
