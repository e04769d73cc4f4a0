"""Choosing a replica: least outstanding among matching replicas in rotation; retries bound to one fingerprint."""

from __future__ import annotations

import pytest

from proxy.errors import ModelNotFound, NoLiveReplica, NoMatchingStack
from proxy.pins import Pin
from proxy.replicas.kinds import STACKPIN, UPSTREAM
from proxy.replicas.registry import Replica
from proxy.serving.router import choose, live_stacks
from proxy.stack import Stack
from tests.support.fake_replica import tiny_stack

INVARIANT = Stack.model_validate(tiny_stack())
DEFAULT = Stack.model_validate(tiny_stack(kernel_mode="default"))


def replica(name: str, stack: Stack, outstanding: int = 0, reachable: bool = True) -> Replica:
    return Replica(
        name,
        f"http://127.0.0.1/{name}",
        STACKPIN,
        stack,
        stack.fingerprint,
        reachable,
        None,
        None,
        outstanding,
    )


def test_least_outstanding_wins_and_ties_go_to_the_name() -> None:
    replicas = [replica("b", INVARIANT, 1), replica("a", INVARIANT, 1), replica("c", INVARIANT, 0)]
    assert choose(replicas, Pin()).name == "c"
    replicas[2].outstanding = 5
    assert choose(replicas, Pin()).name == "a"


def test_a_retry_stays_on_the_first_fingerprint() -> None:
    replicas = [replica("inv", INVARIANT, 0), replica("def", DEFAULT, 0)]
    with pytest.raises(NoLiveReplica):
        choose(replicas, Pin(model="fake-model"), exclude={"inv"}, fingerprint=INVARIANT.fingerprint)


def test_no_match_lists_what_is_live() -> None:
    replicas = [replica("inv", INVARIANT), replica("down", DEFAULT, reachable=False)]
    with pytest.raises(NoMatchingStack) as raised:
        choose(replicas, Pin(hardware="nvidia-h200"))
    assert [s["replicas"] for s in raised.value.extra["live_stacks"]] == [["inv"]]
    with pytest.raises(NoLiveReplica):
        choose(replicas, Pin(kernel_mode="default"))


def test_a_model_no_stack_has_is_openais_404_model_not_found_listing_what_is_live() -> None:
    replicas = [replica("inv", INVARIANT), replica("down", DEFAULT, reachable=False)]
    with pytest.raises(ModelNotFound) as raised:
        choose(replicas, Pin(model="gpt-nothing"))
    error = raised.value
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert "'gpt-nothing'" in error.message and "live models: fake-model" in error.message
    assert [s["replicas"] for s in error.extra["live_stacks"]] == [["inv"]]
    # A known model that the rest of the pin does not match is no missing model: still 409 and 503.
    with pytest.raises(NoMatchingStack) as other:
        choose(replicas, Pin(model="fake-model", hardware="nvidia-h200"))
    assert not isinstance(other.value, ModelNotFound) and other.value.status == 409
    with pytest.raises(NoLiveReplica):
        choose(replicas, Pin(model="fake-model", kernel_mode="default"))


def test_live_stacks_groups_replicas_by_fingerprint() -> None:
    stacks = live_stacks([replica("a", INVARIANT), replica("b", INVARIANT), replica("c", DEFAULT)])
    assert sorted(len(s["replicas"]) for s in stacks) == [1, 2]


def test_only_replicas_that_serve_the_route_are_chosen_and_none_is_a_409_naming_it() -> None:
    upstream = Replica("up", "http://127.0.0.1/up", UPSTREAM, INVARIANT, INVARIANT.fingerprint, True,
                       endpoints=frozenset({"/v1/chat/completions"}))  # fmt: skip
    backend = replica("backend", INVARIANT)
    assert choose([upstream], Pin(), endpoint="/v1/chat/completions").name == "up"
    with pytest.raises(NoMatchingStack, match="serves /v1/embeddings"):
        choose([upstream], Pin(), endpoint="/v1/embeddings")
    # A pinned_backend serves embeddings itself and the Responses API through the proxy's translation.
    assert choose([upstream, backend], Pin(), endpoint="/v1/embeddings").name == "backend"
    assert choose([upstream, backend], Pin(), endpoint="/v1/responses").name == "backend"
    assert backend.serves("/v1/responses") and not backend.natively("/v1/responses")
    served = {s["replicas"][0]: s["serves"] for s in live_stacks([upstream])}
    assert served == {"up": ["/v1/chat/completions"]}
