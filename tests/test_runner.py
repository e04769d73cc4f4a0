"""Specification of pinned_backend.runner: the worker thread survives failed steps, runs chores between steps, and
fails what it holds on stop."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from pinned_backend.engine import EngineStopped
from pinned_backend.runner import EngineRunner
from pinned_backend.sampling import SamplingParams
from tests.support.backend_checkpoint import Collector, make_engine, write_random_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("runner") / "random-qwen3")


class FailingModel:
    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("boom")


def test_the_runner_fails_requests_of_a_failed_step_and_keeps_serving(
    checkpoint: Path,
) -> None:
    engine = make_engine(checkpoint)
    real_model, engine.model = engine.model, FailingModel()
    runner = EngineRunner(engine)
    runner.start()
    try:
        out = Collector()
        runner.submit("a", [1, 2], GREEDY, out)
        assert out.done.wait(30)
        assert "boom" in str(out.errors[0])
        engine.model = real_model
        again = Collector()
        runner.submit("b", [1, 2], GREEDY, again)
        assert again.done.wait(30)
        assert len(again.tokens) == 6
    finally:
        runner.stop()


def test_stopping_the_runner_fails_what_is_still_queued(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    runner = EngineRunner(engine)
    out = Collector()
    engine.submit("a", [1, 2], GREEDY, out)
    runner.start()
    runner.stop()
    assert out.done.is_set()
    assert out.errors or out.outputs[-1].finish_reason is not None


class Chore:
    """A chore of `turns` turns, recording what ran while it did."""

    def __init__(self, engine: object, turns: int, fail_at: int | None = None) -> None:
        self.engine, self.turns, self.fail_at = engine, turns, fail_at
        self.taken = 0
        self.failed: list[Exception] = []
        self.finished = threading.Event()

    def advance(self) -> bool:
        self.taken += 1
        if self.taken == self.fail_at:
            raise RuntimeError("pass failed")
        if self.taken >= self.turns:
            self.finished.set()
            return True
        return False

    def fail(self, error: Exception) -> None:
        self.failed.append(error)
        self.finished.set()


def test_chores_take_turns_between_steps_and_a_failing_one_fails_alone(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    runner = EngineRunner(engine)
    runner.start()
    try:
        out, long_chore, failing = Collector(), Chore(engine, 5), Chore(engine, 5, fail_at=2)
        runner.submit("a", [1, 2], GREEDY, out)
        runner.add_chore(failing)
        runner.add_chore(long_chore)
        assert out.done.wait(30) and failing.finished.wait(30) and long_chore.finished.wait(30)
        assert len(out.tokens) == 6, "the engine's requests carry on while chores take their turns"
        assert "pass failed" in str(failing.failed[0]) and failing.taken == 2
        assert long_chore.taken == 5 and not long_chore.failed
    finally:
        runner.stop()


def test_stopping_the_runner_fails_an_unfinished_chore_and_refuses_new_ones(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    runner = EngineRunner(engine)
    endless = Chore(engine, 10**9)
    runner.start()
    runner.add_chore(endless)
    for _ in range(10_000):
        if endless.taken:
            break
        time.sleep(0.001)
    runner.stop()
    assert endless.failed and isinstance(endless.failed[0], EngineStopped)
    with pytest.raises(EngineStopped):
        runner.add_chore(Chore(engine, 1))


def test_a_runner_started_on_an_executor_steps_on_that_executor_s_one_thread(checkpoint: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    engine_thread = ThreadPoolExecutor(max_workers=1)
    loader = engine_thread.submit(
        threading.get_ident
    ).result()  # the thread that loaded the model, in the server
    engine = make_engine(checkpoint)
    stepped_on: set[int] = set()
    step = engine.step

    def recording_step() -> int:
        stepped_on.add(threading.get_ident())
        return step()

    engine.step = recording_step  # type: ignore[method-assign]
    runner = EngineRunner(engine)
    runner.start(engine_thread)
    try:
        assert runner.alive
        out = Collector()
        runner.submit("a", [1, 2], GREEDY, out)
        assert out.done.wait(30) and len(out.tokens) == 6
    finally:
        runner.stop()
        engine_thread.shutdown()
    assert stepped_on == {loader}
    assert not runner.alive
