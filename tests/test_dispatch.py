"""Dispatch (proxy/serving/dispatch.py): a pinned request goes to a replica whose stack matches its pin, and a retry only
to a replica of the first choice's identical fingerprint (invariant 2); an answer under another fingerprint than
its replica proved is thrown away and reported (invariant 3).

The replicas are fakes on loopback, registered with the stack each proves at `GET /v1/stack`, and every request
is really sent to them, as the proxy sends it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest

from proxy.errors import NoLiveReplica, NoMatchingStack, ReplicaFailed
from proxy.pins import Pin
from proxy.replicas.forward import Answer, ReplicaGarbage, ReplicaRejected, describe, post_json
from proxy.replicas.kinds import STACKPIN, UPSTREAM
from proxy.replicas.registry import Registry, Replica, ReplicaSnapshot
from proxy.serving.dispatch import Dispatched, StackMismatch, dispatch
from proxy.stack import short
from tests.support.fake_replica import FakeReplica, tiny_stack

CHAT = "/v1/chat/completions"
BODY = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 3,
    "temperature": 0,
}
# Generous: no retry deadline or replica timeout here is meant to be reached, except where a test sets its own.
TIMEOUT_S = 60.0
NOW = datetime(2026, 12, 1, tzinfo=UTC)


@dataclass
class Dispatcher:
    """Replicas `replica-0`, `replica-1`, ... for the fakes given, in rotation with the stacks they prove, and
    requests sent to them as the proxy sends them; an answer under the wrong fingerprint quarantines its replica,
    as the health monitor does."""

    session: aiohttp.ClientSession
    registry: Registry = field(default_factory=Registry)
    mismatches: list[StackMismatch] = field(default_factory=list)

    async def register(self, fake: FakeReplica, *, declared: bool = False) -> str:
        name = f"replica-{len(self.registry.all())}"
        self.registry.add(Replica(name, fake.url, UPSTREAM if declared else STACKPIN))
        described = await describe(self.session, fake.url, timeout_s=TIMEOUT_S)
        self.registry.observe(name, described.stack, described.fingerprint, NOW)
        return name

    def replica(self, name: str) -> Replica:
        found = self.registry.get(name)
        assert found is not None
        return found

    async def send(self, replica: ReplicaSnapshot, body: dict[str, Any]) -> Answer:
        answer = await post_json(self.session, replica.url + CHAT, body, api_key=None, timeout_s=TIMEOUT_S)
        replica.kind.check_answer(replica, answer.stack_header, None)
        return answer

    async def mismatched(self, mismatch: StackMismatch) -> None:
        self.mismatches.append(mismatch)
        self.registry.quarantine(mismatch.replica.name, "fingerprint_mismatch")

    async def dispatch(
        self, pin: Pin, body: dict[str, Any] = BODY, *, deadline_s: float = TIMEOUT_S
    ) -> Dispatched[Answer]:
        return await dispatch(
            self.registry,
            pin,
            body,
            self.send,
            endpoint=CHAT,
            deadline_s=deadline_s,
            on_mismatch=self.mismatched,
        )


@pytest.fixture
async def dispatcher() -> AsyncIterator[Dispatcher]:
    async with aiohttp.ClientSession() as session:
        yield Dispatcher(session)


@pytest.fixture
async def other_stack() -> AsyncIterator[FakeReplica]:
    """A replica of another stack than `replica`'s: the same model, quantised."""
    fake = FakeReplica(stack=tiny_stack(quantisation="bf16"))
    await fake.start()
    yield fake
    await fake.stop()


async def test_a_request_goes_to_a_replica_whose_stack_matches_its_pin(
    dispatcher: Dispatcher, replica: FakeReplica, other_stack: FakeReplica
) -> None:
    await dispatcher.register(replica)
    quantised = await dispatcher.register(other_stack)
    dispatched = await dispatcher.dispatch(Pin(quantisation="bf16"))
    assert dispatched.replica.name == quantised
    assert dispatched.result.stack_header == other_stack.fingerprint
    assert len(other_stack.requests) == 1 and not replica.requests


async def test_the_replica_is_sent_the_request_naming_the_model_of_the_stack_that_serves_it(
    dispatcher: Dispatcher, replica: FakeReplica
) -> None:
    await dispatcher.register(replica)
    routed = {**BODY, "model": "support-route"}  # a route's name, which no replica knows
    dispatched = await dispatcher.dispatch(Pin(kernel_mode="batch_invariant"), routed)
    assert replica.requests == [{**BODY, "model": "fake-model"}] == [dispatched.body]
    assert routed["model"] == "support-route", "the caller's body is left as it was"


async def test_a_pin_that_no_stack_matches_is_refused_naming_the_live_stacks_and_nothing_is_sent(
    dispatcher: Dispatcher, replica: FakeReplica
) -> None:
    await dispatcher.register(replica)
    with pytest.raises(NoMatchingStack, match="no stack matches the pin hardware=nvidia-h200") as raised:
        await dispatcher.dispatch(Pin(hardware="nvidia-h200"))
    assert [s["fingerprint"] for s in raised.value.extra["live_stacks"]] == [replica.fingerprint]
    assert not replica.requests


async def test_a_matching_stack_whose_replicas_are_all_out_of_rotation_is_no_live_replica(
    dispatcher: Dispatcher, replica: FakeReplica, twin: FakeReplica
) -> None:
    quarantined, unreachable = await dispatcher.register(replica), await dispatcher.register(twin)
    dispatcher.registry.quarantine(quarantined, "stack_changed")
    dispatcher.registry.unreachable(unreachable)
    with pytest.raises(NoLiveReplica, match="none of their replicas is in rotation"):
        await dispatcher.dispatch(Pin(model="fake-model"))
    assert not replica.requests and not twin.requests


async def test_a_failing_replica_is_retried_on_its_twin_and_never_on_another_stack(
    dispatcher: Dispatcher, replica: FakeReplica, twin: FakeReplica, other_stack: FakeReplica
) -> None:
    first = await dispatcher.register(replica)
    await dispatcher.register(other_stack)  # matches the pin, and comes before the twin by name
    second = await dispatcher.register(twin)
    replica.failure = "500"
    dispatched = await dispatcher.dispatch(Pin(model="fake-model"))
    assert dispatched.replica.name == second and dispatched.result.stack_header == replica.fingerprint
    assert len(replica.requests) == 1 and not other_stack.requests
    assert dispatcher.replica(first).in_rotation, "a replica that answered, even a 5xx, stays in rotation"


async def test_when_every_replica_of_the_fingerprint_fails_the_request_fails_naming_them(
    dispatcher: Dispatcher, replica: FakeReplica, twin: FakeReplica, other_stack: FakeReplica
) -> None:
    first, _, second = [await dispatcher.register(f) for f in (replica, other_stack, twin)]
    replica.failure = twin.failure = "500"
    with pytest.raises(ReplicaFailed) as raised:
        await dispatcher.dispatch(Pin(model="fake-model"))
    assert raised.value.message == (
        f"every replica of stack {short(replica.fingerprint)} failed ({first}, {second}); "
        f"last failure: {second}: replica answered 500"
    )
    assert "live_stacks" in raised.value.extra
    assert not other_stack.requests, "rather fail than drift to another stack"


async def test_a_replica_that_cannot_be_reached_leaves_rotation_and_its_twin_serves(
    dispatcher: Dispatcher, replica: FakeReplica, twin: FakeReplica
) -> None:
    gone, second = await dispatcher.register(replica), await dispatcher.register(twin)
    await replica.stop()
    dispatched = await dispatcher.dispatch(Pin())
    assert dispatched.replica.name == second
    assert not dispatcher.replica(gone).reachable and not dispatcher.replica(gone).in_rotation


async def test_an_answer_under_another_fingerprint_is_thrown_away_reported_and_served_by_a_twin(
    dispatcher: Dispatcher, replica: FakeReplica, twin: FakeReplica
) -> None:
    liar, second = await dispatcher.register(replica), await dispatcher.register(twin)
    replica.failure = "wrong_fingerprint"
    dispatched = await dispatcher.dispatch(Pin())
    assert dispatched.replica.name == second and dispatched.result.stack_header == twin.fingerprint
    [mismatch] = dispatcher.mismatches
    assert mismatch.replica.name == liar and mismatch.claimed == "f" * 64
    assert str(mismatch) == f"replica {liar} answered as stack {'f' * 64}, registered {replica.fingerprint}"


async def test_an_answer_under_another_fingerprint_with_no_twin_fails_the_request(
    dispatcher: Dispatcher, replica: FakeReplica
) -> None:
    await dispatcher.register(replica)
    replica.failure = "wrong_fingerprint"
    with pytest.raises(ReplicaFailed, match=r"answered as stack f{64}"):
        await dispatcher.dispatch(Pin())
    assert len(dispatcher.mismatches) == 1


async def test_a_declared_upstream_cannot_prove_its_stack_so_its_answer_is_not_checked(
    dispatcher: Dispatcher, replica: FakeReplica
) -> None:
    upstream = await dispatcher.register(replica, declared=True)
    replica.failure = "wrong_fingerprint"
    dispatched = await dispatcher.dispatch(Pin())
    assert dispatched.replica.name == upstream and not dispatcher.mismatches


async def test_a_declared_upstream_that_could_not_be_reached_once_stays_in_rotation(
    dispatcher: Dispatcher, replica: FakeReplica
) -> None:
    # No health check ever reaches a declared upstream (it has no stack to prove), so taken out it would stay out.
    upstream = await dispatcher.register(replica, declared=True)
    await replica.stop()
    with pytest.raises(ReplicaFailed):
        await dispatcher.dispatch(Pin())
    assert dispatcher.replica(upstream).in_rotation
    await replica.start(port=int(replica.url.rsplit(":", 1)[1]))
    assert (await dispatcher.dispatch(Pin())).replica.name == upstream


async def test_garbage_and_rejections_are_not_retried(
    dispatcher: Dispatcher, replica: FakeReplica, twin: FakeReplica
) -> None:
    await dispatcher.register(replica)
    await dispatcher.register(twin)
    with pytest.raises(ReplicaRejected):
        await dispatcher.dispatch(Pin(), {**BODY, "max_tokens": 0})  # the client's problem, on any replica
    replica.failure = "garbage"
    with pytest.raises(ReplicaGarbage):
        await dispatcher.dispatch(Pin())
    assert len(replica.requests) == 2 and not twin.requests


async def test_no_retry_starts_once_the_deadline_has_passed(
    dispatcher: Dispatcher, replica: FakeReplica, twin: FakeReplica
) -> None:
    first = await dispatcher.register(replica)
    await dispatcher.register(twin)
    replica.failure = "500"
    with pytest.raises(ReplicaFailed) as raised:
        await dispatcher.dispatch(Pin(), deadline_s=0)
    assert raised.value.message == (
        f"no replica of stack {short(replica.fingerprint)} answered in 0 s: {first}: replica answered 500"
    )
    assert not twin.requests


async def test_a_proved_replica_must_answer_under_its_fingerprint_and_a_declared_one_cannot_prove(
    dispatcher: Dispatcher, replica: FakeReplica
) -> None:
    proved = dispatcher.replica(await dispatcher.register(replica)).snapshot()
    declared = dispatcher.replica(await dispatcher.register(replica, declared=True)).snapshot()
    proved.kind.check_answer(proved, replica.fingerprint, None)
    proved.kind.check_answer(proved, None, {"system_fingerprint": replica.fingerprint})
    for claimed in (None, "f" * 64):
        with pytest.raises(StackMismatch) as raised:
            proved.kind.check_answer(proved, claimed, None)
        assert raised.value.replica is proved and raised.value.claimed == claimed
        declared.kind.check_answer(declared, claimed, None)
