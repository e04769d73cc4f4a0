"""How far a replayed answer agrees with its original, as one of five levels, strongest first:

    identical       every part of the answer, token ids and logprob bits included (a replay's `reproduced`)
    same_tokens     the same token ids and the same text, where something else differs (logprob bits, usage)
    same_text       the same text in every part (content, refusal, text, tool calls' names and argument strings)
    same_json       the same tool calls (names, and arguments read as JSON) and the same JSON content, written
                    otherwise (key order, spacing, 1.0 for 1): the same for a program that reads it
    diverged        none of these

A requirement (`identical>=0.999`) asks that a share of the replays agree *at least* that well: a replay that is
identical also counts towards same_text. Embeddings have no text: they are identical or diverged. Pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.canonical import NotCanonicalizable, canonical_json
from proxy.evidence.answers import View
from proxy.evidence.compare import Comparison

LEVELS = ("identical", "same_tokens", "same_text", "same_json", "diverged")
FAILED = "failed"  # a replay that did not come back: it agrees with nothing
_REQUIREMENT = re.compile(r"^(?P<level>[a-z_]+)\s*>=\s*(?P<share>[0-9]*\.?[0-9]+)(?P<percent>%?)$")


def agreement(original: View, replayed: View, comparison: Comparison) -> str:
    if comparison.outcome == "reproduced":
        return "identical"
    if original.kind == "embedding":
        return "diverged"
    if _texts(original) == _texts(replayed):
        a, b = original.tokens, replayed.tokens
        same_ids = a is not None and b is not None and a.token_ids is not None and a.token_ids == b.token_ids
        return "same_tokens" if same_ids else "same_text"
    if _structure(original) == _structure(replayed):
        return "same_json"
    return "diverged"


def _texts(view: View) -> list[Any]:
    return [_part_text(part.fields) for part in view.parts]


def _part_text(fields: Mapping[str, Any]) -> Any:
    message = fields.get("message") if isinstance(fields.get("message"), dict) else {}
    if "type" in fields:  # a Responses output item
        return [fields.get("type"), fields.get("name"), fields.get("arguments"), fields.get("content")]
    calls = [
        (call.get("function") or {}) if isinstance(call, dict) else call
        for call in message.get("tool_calls") or []
    ]
    return [
        fields.get("text"),
        message.get("content"),
        message.get("refusal"),
        [(c.get("name"), c.get("arguments")) if isinstance(c, dict) else c for c in calls],
        message.get("function_call"),
    ]


def _structure(view: View) -> list[Any]:
    """Each part's text with every string that holds a JSON object or array read as its canonical JSON."""
    return _as_json(_texts(view))


def _as_json(value: Any) -> Any:
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] in ("{", "["):
            try:
                return ("json", canonical_json(json.loads(stripped)))
            except (ValueError, NotCanonicalizable):
                return value
        return value
    if isinstance(value, list | tuple):
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Requirement:
    level: str
    share: float

    def __str__(self) -> str:
        return f"{self.level}>={self.share:g}"

    def met(self, counts: Mapping[str, int]) -> bool:
        share = at_least(counts, self.level)
        return share is not None and share >= self.share


def at_least(counts: Mapping[str, int], level: str) -> float | None:
    """The share of the replays counted (failed ones too) that agree at least as well as `level`."""
    total = sum(counts.get(name, 0) for name in (*LEVELS, FAILED))
    if not total:
        return None
    strong = LEVELS[: LEVELS.index(level) + 1]
    return sum(counts.get(name, 0) for name in strong) / total


def parse_requirement(text: str) -> Requirement:
    """`identical>=0.999`, `same_text>=99%`; ValueError saying how to write one."""
    match = _REQUIREMENT.match(text.strip())
    levels = ", ".join(LEVELS[:-1])
    if match is None or match["level"] not in LEVELS[:-1]:
        raise ValueError(
            f"a requirement is LEVEL>=SHARE, LEVEL one of {levels}; e.g. identical>=0.999; got {text!r}"
        )
    share = float(match["share"]) / (100 if match["percent"] else 1)
    if not 0 <= share <= 1:
        raise ValueError(f"a requirement's share is from 0 to 1 (or 0% to 100%); got {text!r}")
    return Requirement(match["level"], share)
