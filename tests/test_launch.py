"""How a serving process is launched (proxy/process/launch.py): what it sets up once start-up is done. Starting and stopping
`stackpin serve` itself is specified in test_cli.py and test_supervisor.py."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from proxy.process.launch import YOUNG_COLLECTION_THRESHOLD, collect_for_serving


@pytest.fixture
def collector_restored() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("collector_restored")
def test_serving_freezes_what_start_up_built_and_collects_young_objects_less_often() -> None:
    _, middle, oldest = gc.get_threshold()
    built_at_start: list[list[str]] = [["long-lived"]]  # lists are always tracked by the collector
    assert any(o is built_at_start for o in gc.get_objects())
    collect_for_serving()
    # gc.get_objects() lists the generations collections walk, not the frozen ones.
    assert not any(o is built_at_start for o in gc.get_objects()), "start-up's objects are never walked again"
    assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, middle, oldest)


@pytest.mark.usefixtures("collector_restored")
def test_garbage_left_by_start_up_is_collected_before_the_freeze() -> None:
    class Cycle:
        pass

    left = Cycle()
    left.me = left  # type: ignore[attr-defined]
    watched = weakref.ref(left)
    del left
    collect_for_serving()
    assert watched() is None, "a cycle start-up dropped is freed, not frozen"
