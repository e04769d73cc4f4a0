"""Pins: parsed from the header, the body field and named routes, combined by narrowing, matched to stacks."""

from __future__ import annotations

import pytest

from proxy.errors import BadRequest
from proxy.pins import STACK_KEYS, Pin, parse_pin_body, parse_pin_header, resolve_request_pin
from proxy.stack import Stack
from tests.support.fake_replica import tiny_stack

STACK = Stack.model_validate(tiny_stack())


def test_the_header_form_parses_every_key() -> None:
    pin = parse_pin_header(
        "model=qwen3-8b, quantisation=bf16, hardware=nvidia-h200, kernel_mode=batch_invariant, prompt=support@3"
    )
    assert pin == Pin(
        model="qwen3-8b",
        quantisation="bf16",
        hardware="nvidia-h200",
        kernel_mode="batch_invariant",
        prompt="support@3",
    )


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        ("colour=blue", "unknown pin key"),
        ("model", "key=value"),
        ("model=a, model=b", "twice"),
        ("stack=abc", "64-character"),
        ("prompt=support", "name@N"),
    ],
)
def test_bad_headers_say_what_to_fix(header: str, fragment: str) -> None:
    with pytest.raises(BadRequest, match=fragment):
        parse_pin_header(header)


def test_the_body_field_must_be_an_object_of_strings() -> None:
    assert parse_pin_body({"kernel_mode": "default"}) == Pin(kernel_mode="default")
    with pytest.raises(BadRequest):
        parse_pin_body(["kernel_mode"])
    with pytest.raises(BadRequest):
        parse_pin_body({"kernel_mode": 3})


def test_model_names_a_route_first_else_pins_the_model() -> None:
    routes = {"support": Pin(model="fake-model", prompt="support@3")}
    assert resolve_request_pin(model="support", header=None, body_pin=None, routes=routes) == (
        routes["support"],
        "support",
    )
    assert resolve_request_pin(model="other", header=None, body_pin=None, routes=routes) == (
        Pin(model="other"),
        None,
    )


def test_header_and_body_narrow_and_a_contradiction_is_refused() -> None:
    pin, _ = resolve_request_pin(
        model="fake-model",
        header="kernel_mode=batch_invariant",
        body_pin={"hardware": "cpu-x86_64-avx512"},
        routes={},
    )
    assert pin == Pin(model="fake-model", kernel_mode="batch_invariant", hardware="cpu-x86_64-avx512")
    with pytest.raises(BadRequest, match="send one value"):
        resolve_request_pin(model="fake-model", header="model=other", body_pin=None, routes={})


def test_matching_ignores_the_prompt_and_honours_an_exact_fingerprint() -> None:
    assert Pin(model="fake-model", prompt="support@3").matches(STACK, STACK.fingerprint)
    assert not Pin(kernel_mode="default").matches(STACK, STACK.fingerprint)
    assert Pin(stack=STACK.fingerprint).matches(STACK, STACK.fingerprint)
    assert not Pin(stack="0" * 64).matches(STACK, STACK.fingerprint)


@pytest.mark.parametrize("key", STACK_KEYS)
def test_each_stack_key_a_pin_names_must_equal_the_stacks_own(key: str) -> None:
    own = getattr(STACK, key)
    assert Pin(**{key: own}).matches(STACK, STACK.fingerprint)
    assert not Pin(**{key: own + "-other"}).matches(STACK, STACK.fingerprint)
    assert not Pin(**{key: own, "stack": "0" * 64}).matches(STACK, STACK.fingerprint)


def test_a_batch_invariant_pin_takes_only_a_stack_whose_answers_are_batch_invariant() -> None:
    pin = Pin(kernel_mode="batch_invariant")
    capped = {"policy": "capacity", "capacity_factor": 1.0, "overflow": "pass_through"}
    dropless = Stack.model_validate(
        {**tiny_stack(), "batching": {**STACK.batching, "expert_routing": {"policy": "dropless"}}}
    )
    assert pin.matches(dropless, dropless.fingerprint)
    honest = Stack.model_validate(
        {
            **tiny_stack(),
            "kernel_mode": "batch_invariant_kernels",
            "batching": {**STACK.batching, "expert_routing": capped},
        }
    )
    assert not pin.matches(honest, honest.fingerprint)
    assert Pin(kernel_mode="batch_invariant_kernels").matches(honest, honest.fingerprint)
    # A stack that claims both (an older backend) is taken at its routing, not its word.
    claiming = Stack.model_validate(
        {**tiny_stack(), "batching": {**STACK.batching, "expert_routing": capped}}
    )
    assert not pin.matches(claiming, claiming.fingerprint)
    assert Pin(model=claiming.model).matches(claiming, claiming.fingerprint)
