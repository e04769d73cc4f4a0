"""Specification of pinned_backend.engine: continuous batching, chunked prefill, KV budget, bounds, stops."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pinned_backend.engine import (
    Engine,
    EngineConfig,
    QueueFull,
    RequestTooLarge,
    StepStats,
)
from pinned_backend.sampling import SamplingParams
from tests.backend_checkpoint import Collector, letters, write_random_checkpoint
from tests.backend_checkpoint import make_engine as make_checkpoint_engine

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
