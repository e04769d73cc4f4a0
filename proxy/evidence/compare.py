"""Replay comparison: is a replayed answer identical to the original in every part, and if not, where does it first
differ?

Compared, in this order, and the first difference reported: the token ids and logprob bits the replica reports
(choice 0's), then each part in turn (every choice, embedding or output item: its content, refusal, tool calls
with their names and argument strings, legacy function call, finish reason, logprobs, everything else it holds),
then how many parts there are, then what the answer says as a whole (usage, status, the prompt's token ids), and
for a stream every event in order. Strings are compared character by character, lists element by element, numbers
by their bits (a float's hex form never rounds), so a divergence names the part, the field, the first differing
position and both continuations. Values that differ between two runs by design (ids, clocks, the random padding
of stream events: `answers.VOLATILE`) are left out. One exception to bits: the audit log's canonical JSON (RFC
8785) writes -0.0 as 0, so a recorded answer cannot tell the two zeros apart, and neither does the comparison.
Pure functions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from proxy.evidence.answers import Tokens, View, steady_event

CONTEXT_TOKENS = 16
CONTEXT_CHARS = 80
# A part's fields in the order a reader looks at them; any others follow in their own order.
FIRST_KEYS = (
    "message",
    "text",
    "content",
    "refusal",
    "tool_calls",
    "function_call",
    "finish_reason",
    "logprobs",
)


@dataclass(frozen=True)
class Comparison:
    outcome: Literal["reproduced", "diverged"]
    compared: Literal["tokens", "answer"]  # "tokens" when both answers carry token ids and logprobs
    part: str | None = None  # "choice 1", "data[3]", "output[0]"
    choice: int | None = None  # that part's index
    field: str | None = (
        None  # "tokens", "message.tool_calls[0].function.arguments", "choices", "usage", "events"
    )
    event: int | None = None  # the stream event, when the answers agree and their events do not
    position: int | None = None  # first differing token, character or element
    reason: str | None = None  # token, logprob, length, text, value, missing, count
    original: str | None = None  # continuations from the divergence on
    replayed: str | None = None
    original_ids: list[int] | None = None
    replayed_ids: list[int] | None = None
    original_logprob: str | None = None  # hex bits of the divergent token logprobs
    replayed_logprob: str | None = None
    original_bits: str | None = None  # hex bits of other divergent numbers (an embedding's component)
    replayed_bits: str | None = None
    agreement: str | None = None  # how far the answers agree all the same (proxy/evidence/agreement.py)

    def as_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    def where(self) -> str:
        return where(self.as_json())


def where(result: Mapping[str, Any]) -> str:
    """A divergence's place in words, from a comparison's JSON: `token 3 of choice 0`, or `choice 1, field
    message.tool_calls[0].function.arguments, character 12`, or `event 4, field choices[0].delta.content, ...`."""
    if result.get("field") == "tokens":
        return f"token {result.get('position')}" + (f" of {result['part']}" if result.get("part") else "")
    head, position = place(result)
    return f"{head} {position}" if position is not None else head.rsplit(", ", 1)[0]


def place(result: Mapping[str, Any]) -> tuple[str, int | None]:
    """A divergence's place up to the unit its position counts (`choice 1, field message.content, character`),
    and that position."""
    reason, field = result.get("reason"), result.get("field")
    unit = (
        "token"
        if field in (None, "tokens") and reason in ("token", "logprob")
        else "character"
        if reason == "text"
        else "item"
        if reason in ("count", "length")
        else "position"
    )
    places = [
        f"event {result['event']}" if result.get("event") is not None else None,
        result.get("part") if field != "tokens" else None,
        f"field {field}" if field and field != "tokens" else None,
        unit,
    ]
    return ", ".join(p for p in places if p), result.get("position")


@dataclass(frozen=True)
class _Difference:
    path: str
    position: int | None
    reason: str
    original: str
    replayed: str
    bits: tuple[str, str] | None = None


def compare(
    original: View,
    replayed: View,
    original_events: list[str] | None = None,
    replayed_events: list[str] | None = None,
) -> Comparison:
    """`*_events` are the exact events a stream's client read (answers.steady_event reads them); None for an
    answer that was not streamed, or a record that kept no events."""
    compared: Literal["tokens", "answer"] = (
        "tokens" if original.tokens is not None and replayed.tokens is not None else "answer"
    )
    if original.tokens is not None and replayed.tokens is not None:
        diverged = _compare_tokens(original.tokens, replayed.tokens)
        if diverged is not None:
            label = original.parts[0].label if original.parts else None
            return Comparison(
                **{**diverged, "compared": compared, "part": label, "choice": 0 if label else None}
            )
    for a, b in zip(original.parts, replayed.parts, strict=False):
        found = _first_difference(a.fields, b.fields, "")
        if found is not None:
            return _diverged(compared, found, part=a.label, choice=a.index)
    if len(original.parts) != len(replayed.parts):
        n = min(len(original.parts), len(replayed.parts))
        plural = {"choice": "choices", "embedding": "data", "output item": "output"}[original.kind]
        counts = _Difference(
            plural, n, "count", f"{len(original.parts)} {plural}", f"{len(replayed.parts)} {plural}"
        )
        return _diverged(compared, counts)
    found = _first_difference(original.fields, replayed.fields, "")
    if found is not None:
        return _diverged(compared, found)
    if original_events is not None and replayed_events is not None:
        return _compare_events(compared, original_events, replayed_events)
    return Comparison("reproduced", compared)


def _compare_events(
    compared: Literal["tokens", "answer"], original: list[str], replayed: list[str]
) -> Comparison:
    for k, (a, b) in enumerate(zip(original, replayed, strict=False)):
        (name_a, data_a), (name_b, data_b) = steady_event(a), steady_event(b)
        found = (
            _first_difference(data_a, data_b, "")
            if name_a == name_b
            else _Difference("event", None, "value", str(name_a), str(name_b))
        )
        if found is not None:
            return _diverged(compared, found, event=k)
    if len(original) != len(replayed):
        n = min(len(original), len(replayed))
        counts = _Difference("events", n, "count", f"{len(original)} events", f"{len(replayed)} events")
        return _diverged(compared, counts, event=n)
    return Comparison("reproduced", compared)


def _diverged(compared: Literal["tokens", "answer"], found: _Difference, **where: Any) -> Comparison:
    return Comparison(
        "diverged",
        compared,
        field=found.path or None,
        position=found.position,
        reason=found.reason,
        original=found.original,
        replayed=found.replayed,
        original_bits=found.bits[0] if found.bits else None,
        replayed_bits=found.bits[1] if found.bits else None,
        **where,
    )


def _compare_tokens(original: Tokens, replayed: Tokens) -> dict[str, Any] | None:
    a_ids, b_ids = original.token_ids or [], replayed.token_ids or []
    a_lp, b_lp = original.token_logprobs or [], replayed.token_logprobs or []
    for k in range(max(len(a_ids), len(b_ids))):
        if k >= len(a_ids) or k >= len(b_ids):
            return _token_divergence(original, replayed, k, "length")
        if a_ids[k] != b_ids[k]:
            return _token_divergence(original, replayed, k, "token")
        a_bits = _bits(a_lp[k]) if k < len(a_lp) else None
        b_bits = _bits(b_lp[k]) if k < len(b_lp) else None
        if a_bits != b_bits:
            return _token_divergence(original, replayed, k, "logprob", a_bits, b_bits)
    return None


def _token_divergence(
    original: Tokens,
    replayed: Tokens,
    k: int,
    reason: str,
    a_bits: str | None = None,
    b_bits: str | None = None,
) -> dict[str, Any]:
    char = _first_char(original.text, replayed.text)
    return {
        "outcome": "diverged",
        "field": "tokens",
        "position": k,
        "reason": reason,
        "original": original.text[char : char + CONTEXT_CHARS],
        "replayed": replayed.text[char : char + CONTEXT_CHARS],
        "original_ids": (original.token_ids or [])[k : k + CONTEXT_TOKENS],
        "replayed_ids": (replayed.token_ids or [])[k : k + CONTEXT_TOKENS],
        "original_logprob": a_bits,
        "replayed_logprob": b_bits,
    }


def _first_difference(a: Any, b: Any, path: str) -> _Difference | None:
    if isinstance(a, str) and isinstance(b, str):
        if a == b:
            return None
        k = _first_char(a, b)
        return _Difference(path, k, "text", a[k : k + CONTEXT_CHARS], b[k : k + CONTEXT_CHARS])
    if _is_number(a) and _is_number(b):
        if (a == b) if isinstance(a, int) and isinstance(b, int) else _bits(a) == _bits(b):
            return None
        return _Difference(path, None, "value", repr(a), repr(b), (_number_bits(a), _number_bits(b)))
    if isinstance(a, list) and isinstance(b, list):
        for k, (x, y) in enumerate(zip(a, b, strict=False)):
            found = _first_difference(x, y, f"{path}[{k}]")
            if found is not None and found.position is None and found.path == f"{path}[{k}]":
                # A number of a list (an embedding's component): the list is the field, k the position.
                return _Difference(path, k, found.reason, found.original, found.replayed, found.bits)
            if found is not None:
                return found
        if len(a) != len(b):
            n = min(len(a), len(b))
            return _Difference(path, n, "length", _show(a[n:]), _show(b[n:]))
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        for key in _key_order(a, b):
            where = f"{path}.{key}" if path else str(key)
            if (key in a) != (key in b):
                return _Difference(
                    where, None, "missing", _show(a.get(key, "(absent)")), _show(b.get(key, "(absent)"))
                )
            found = _first_difference(a[key], b[key], where)
            if found is not None:
                return found
        return None
    if a == b and type(a) is type(b):
        return None
    return _Difference(path, None, "value", _show(a), _show(b))


def _key_order(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    keys = list(dict.fromkeys([*a, *b]))
    first = [k for k in FIRST_KEYS if k in keys]
    return first + [k for k in keys if k not in first]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bits(number: float) -> str:
    return (float(number) + 0.0).hex()  # + 0.0 turns -0.0 into 0.0 and leaves every other value alone


def _number_bits(number: float) -> str:
    return str(number) if isinstance(number, int) else _bits(number)


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    return text[:CONTEXT_CHARS]


def _first_char(a: str, b: str) -> int:
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return min(len(a), len(b))
