"""Pins: what a request demands of the stack that serves it, and whether a stack satisfies it.

A pin comes from a named route, the `Stackpin-Pin` header (`key=value, key=value`) and the body field `stackpin`
(a JSON object); they combine by narrowing, and a key given twice with different values is a contradiction the
client must resolve. `prompt` is not a property of the stack: the proxy applies it, so it takes no part in matching.
Everything here is pure.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from proxy.errors import BadRequest
from proxy.stack import BATCH_INVARIANT, Stack

PIN_KEYS = ("model", "quantisation", "hardware", "kernel_mode", "prompt", "stack")
STACK_KEYS = ("model", "quantisation", "hardware", "kernel_mode")
_PROMPT_REF = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)@(?P<version>[1-9][0-9]*)$")
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")


class Pin(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None
    quantisation: str | None = None
    hardware: str | None = None
    kernel_mode: str | None = None
    prompt: str | None = None
    stack: str | None = None

    def narrowed_by(self, other: Pin, *, source: str) -> Pin:
        merged = self.model_dump(exclude_none=True)
        for key, value in other.model_dump(exclude_none=True).items():
            if key in merged and merged[key] != value:
                raise BadRequest(
                    f"the pin from {source} asks for {key}={value} but the request already pins "
                    f"{key}={merged[key]}; send one value",
                    param="stackpin",
                )
            merged[key] = value
        return Pin(**merged)

    def matches(self, stack: Stack, fingerprint: str) -> bool:
        # STACK_KEYS written out rather than looped over: every request tests every replica with this.
        if self.stack is not None and self.stack != fingerprint:
            return False
        return (
            (self.model is None or self.model == stack.model)
            and (self.quantisation is None or self.quantisation == stack.quantisation)
            and (self.hardware is None or self.hardware == stack.hardware)
            and (self.kernel_mode is None or self.kernel_mode == stack.kernel_mode)
            # Pinned for invariance, a request gets a stack whose answers are invariant, not one that says so.
            and (self.kernel_mode != BATCH_INVARIANT or stack.batch_invariant)
        )

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.model_dump(exclude_none=True).items()) or "(any)"


def parse_prompt_ref(ref: str) -> tuple[str, int]:
    match = _PROMPT_REF.match(ref)
    if match is None:
        raise BadRequest(f"prompt version {ref!r} must look like name@N, e.g. support@3", param="prompt")
    return match["name"], int(match["version"])


def pin_from_mapping(values: dict[str, Any], *, source: str) -> Pin:
    unknown = sorted(set(values) - set(PIN_KEYS))
    if unknown:
        raise BadRequest(
            f"unknown pin key(s) {unknown} in {source}; the keys are {', '.join(PIN_KEYS)}", param="stackpin"
        )
    for key, value in values.items():
        if not isinstance(value, str) or not value:
            raise BadRequest(f"pin key {key!r} in {source} must be a non-empty string", param="stackpin")
    if "stack" in values and not _FINGERPRINT.match(values["stack"]):
        raise BadRequest(
            f"pin stack= in {source} must be a 64-character lowercase hex fingerprint", param="stackpin"
        )
    if "prompt" in values:
        parse_prompt_ref(values["prompt"])
    try:
        return Pin(**values)
    except ValidationError as e:  # pragma: no cover - the checks above cover every field
        raise BadRequest(f"invalid pin in {source}: {e}", param="stackpin") from e


def parse_pin_header(header: str) -> Pin:
    """`Stackpin-Pin: model=qwen3-8b, kernel_mode=batch_invariant` -> Pin."""
    values: dict[str, Any] = {}
    for part in header.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise BadRequest(
                f"Stackpin-Pin header part {part!r} must be key=value, e.g. 'model=qwen3-8b, kernel_mode=default'",
                param="Stackpin-Pin",
            )
        if key in values:
            raise BadRequest(f"Stackpin-Pin header gives {key!r} twice", param="Stackpin-Pin")
        values[key] = value
    return pin_from_mapping(values, source="the Stackpin-Pin header")


def parse_pin_body(value: Any) -> Pin:
    if not isinstance(value, dict):
        raise BadRequest("body field 'stackpin' must be a JSON object of pin keys", param="stackpin")
    return pin_from_mapping(value, source="the body field 'stackpin'")


def resolve_request_pin(
    *, model: str | None, header: str | None, body_pin: Any, routes: dict[str, Pin]
) -> tuple[Pin, str | None]:
    """The request's effective pin, and the route name when `model` named one.

    An application that changes only its base URL still sends `model`: it names a route if one has that name,
    else it pins the model. The header and the body field narrow that further.
    """
    route_name = model if model is not None and model in routes else None
    if route_name is not None:
        pin = routes[route_name]
    elif model is not None:
        pin = Pin(model=model)
    else:
        pin = Pin()
    if header is not None:
        pin = pin.narrowed_by(parse_pin_header(header), source="the Stackpin-Pin header")
    if body_pin is not None:
        pin = pin.narrowed_by(parse_pin_body(body_pin), source="the body field 'stackpin'")
    return pin, route_name
