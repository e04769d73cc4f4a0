"""The replica registry: a replica serves once its stack is known, leaves rotation when unreachable or quarantined,
and every change to it goes through the registry; what a request was served by is a snapshot no change reaches."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from proxy.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from proxy.replicas.kinds import STACKPIN, UPSTREAM
from proxy.replicas.registry import Observation, Registry, Replica
from proxy.stack import Stack
from tests.support.fake_replica import fingerprint_of, tiny_stack

T0 = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
PROVED = Stack.model_validate(tiny_stack())
CHANGED = Stack.model_validate(tiny_stack(quantisation="bf16"))


def proved(name: str = "backend") -> Replica:
    return Replica(name=name, url=f"http://127.0.0.1:1/{name}", kind=STACKPIN)


def declared(name: str = "upstream", endpoints: frozenset[str] = frozenset({CHAT})) -> Replica:
    return Replica(
        name=name,
        url=f"http://127.0.0.1:1/{name}",
        kind=UPSTREAM,
        stack=PROVED,
        fingerprint=fingerprint_of(tiny_stack()),
        reachable=True,
        endpoints=endpoints,
    )


class Counts:
    """An OutstandingCounter that remembers what it was told, as the fleet's shared counts are told."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, int]] = []

    def moved(self, name: str, delta: int) -> None:
        self.moves.append((name, delta))


def test_a_proved_replica_serves_only_once_it_has_proved_its_stack() -> None:
    registry = Registry.of([proved()])
    assert registry.live() == []
    assert registry.observe("backend", PROVED, fingerprint_of(tiny_stack()), T0) is Observation.FIRST
    (live,) = registry.live()
    assert live.fingerprint == fingerprint_of(tiny_stack()) and live.last_good_check == T0


def test_a_declared_replica_serves_on_its_declaration() -> None:
    registry = Registry.of([declared()])
    assert [r.name for r in registry.live()] == ["upstream"]


def test_the_same_stack_again_is_a_good_check_and_another_one_changes_nothing_registered() -> None:
    registry = Registry.of([proved()])
    registry.observe("backend", PROVED, fingerprint_of(tiny_stack()), T0)
    later = T0 + timedelta(minutes=1)
    assert registry.observe("backend", PROVED, fingerprint_of(tiny_stack()), later) is Observation.SAME
    changed = fingerprint_of(tiny_stack(quantisation="bf16"))
    assert registry.observe("backend", CHANGED, changed, later + timedelta(minutes=1)) is Observation.CHANGED
    replica = registry.get("backend")
    assert replica is not None and replica.stack == PROVED, "the registered stack stays what was proved first"
    assert replica.last_good_check == later, "a changed stack is no good check"


def test_an_unreachable_replica_leaves_rotation_and_returns_when_it_proves_the_same_stack() -> None:
    registry = Registry.of([proved()])
    registry.observe("backend", PROVED, fingerprint_of(tiny_stack()), T0)
    registry.unreachable("backend")
    assert registry.live() == []
    registry.observe("backend", PROVED, fingerprint_of(tiny_stack()), T0 + timedelta(seconds=5))
    assert [r.name for r in registry.live()] == ["backend"]


def test_a_quarantined_replica_stays_out_and_its_last_good_check_does_not_move() -> None:
    registry = Registry.of([proved()])
    registry.observe("backend", PROVED, fingerprint_of(tiny_stack()), T0)
    registry.quarantine("backend", "stack_changed")
    registry.observe("backend", PROVED, fingerprint_of(tiny_stack()), T0 + timedelta(minutes=5))
    replica = registry.get("backend")
    assert replica is not None and not replica.in_rotation and replica.quarantined == "stack_changed"
    assert replica.last_good_check == T0, "nothing it served while quarantined is vouched for"


def test_a_lifted_proved_replica_comes_back_as_if_new() -> None:
    registry = Registry.of([proved()])
    registry.observe("backend", PROVED, fingerprint_of(tiny_stack()), T0)
    registry.quarantine("backend", "stack_changed")
    lifted_at = T0 + timedelta(hours=1)
    registry.lift("backend", lifted_at)
    replica = registry.get("backend")
    assert replica is not None and replica.quarantined is None and replica.fingerprint is None
    assert replica.last_good_check == lifted_at and not replica.in_rotation, (
        "out until it proves a stack again"
    )
    new = fingerprint_of(tiny_stack(quantisation="bf16"))
    assert registry.observe("backend", CHANGED, new, lifted_at) is Observation.FIRST, (
        "the new stack is its own"
    )


def test_a_lifted_declared_replica_keeps_its_declared_stack() -> None:
    registry = Registry.of([declared()])
    registry.quarantine("upstream", "fingerprint_mismatch")
    registry.lift("upstream", T0)
    (live,) = registry.live()
    assert live.stack == PROVED and live.fingerprint == fingerprint_of(tiny_stack())


def test_requests_in_flight_are_counted_and_told_to_the_counter_it_was_built_with() -> None:
    counts = Counts()
    shared = Registry({"upstream": declared()}, counter=counts)
    shared.acquire("upstream")
    shared.acquire("upstream")
    replica = shared.get("upstream")
    assert replica is not None and replica.outstanding == 2
    shared.release("upstream")
    assert replica.outstanding == 1
    assert counts.moves == [("upstream", 1), ("upstream", 1), ("upstream", -1)]


def test_a_lease_moves_the_replica_and_the_fleet_sets_its_outstanding_count() -> None:
    registry = Registry.of([proved()])
    registry.lease("backend", "http://127.0.0.1:2/moved")
    registry.count_outstanding("backend", 7)
    replica = registry.get("backend")
    assert replica is not None and replica.leased and replica.url == "http://127.0.0.1:2/moved"
    assert replica.outstanding == 7


def test_a_snapshot_is_what_the_replica_was_whatever_happens_to_it_after() -> None:
    registry = Registry.of([proved()])
    registry.observe("backend", PROVED, fingerprint_of(tiny_stack()), T0)
    replica = registry.get("backend")
    assert replica is not None
    snapshot = replica.snapshot()
    registry.quarantine("backend", "stack_changed")
    registry.lift("backend", T0 + timedelta(hours=1))
    registry.lease("backend", "http://127.0.0.1:2/elsewhere")
    registry.observe("backend", CHANGED, fingerprint_of(tiny_stack(quantisation="bf16")), T0)
    assert snapshot.stack == PROVED and snapshot.fingerprint == fingerprint_of(tiny_stack())
    assert snapshot.url == "http://127.0.0.1:1/backend" and snapshot.stack_source == "proven"
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.fingerprint = "0" * 64  # type: ignore[misc]


def test_a_pinned_backend_serves_responses_by_translation_and_an_upstream_what_it_declares() -> None:
    backend = proved()
    assert backend.serves(RESPONSES) and not backend.natively(RESPONSES)
    assert backend.serves(CHAT) and backend.serves(COMPLETIONS) and backend.serves(EMBEDDINGS)
    upstream = declared(endpoints=frozenset({CHAT}))
    assert upstream.serves(CHAT) and not upstream.serves(RESPONSES) and not upstream.serves(EMBEDDINGS)
    assert upstream.snapshot().natively(CHAT) and not upstream.snapshot().natively(RESPONSES)
