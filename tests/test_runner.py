"""Specification of pinned_backend.runner: the worker thread survives failed steps and fails what it holds on stop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pinned_backend.runner import EngineRunner
from pinned_backend.sampling import SamplingParams
from tests.backend_checkpoint import Collector, make_engine, write_random_checkpoint

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
