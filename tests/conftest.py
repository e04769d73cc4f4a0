"""Shared fixtures: fake replicas on loopback for the proxy's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.fake_replica import FakeReplica


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
