"""Stack documents side by side: a stack's keys marked where it differs from other stacks, and two stacks' diff.

A stack document (proxy/stack.py) nests objects (`software.torch`, `batching.kv_split_size`); both views flatten it
to dotted keys, so that a difference is named by the one value that makes it. Values are shown as JSON text. Pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KeyRow:
    key: str
    value: str
    differs_from: int  # how many of the other stacks have another value here
    others: int

    @property
    def distinct(self) -> bool:
        return self.differs_from > 0


@dataclass(frozen=True)
class DiffRow:
    key: str
    a: str
    b: str

    @property
    def same(self) -> bool:
        return self.a == self.b


ABSENT = "(absent)"


def flatten(document: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key in sorted(document):
        value = document[key]
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return flat


def distinguish(stack: dict[str, Any], others: list[dict[str, Any]]) -> list[KeyRow]:
    """Every key of `stack`, and how many of `others` differ from it there."""
    own = flatten(stack)
    flat_others = [flatten(other) for other in others]
    keys = sorted(set(own).union(*flat_others)) if flat_others else sorted(own)
    return [
        KeyRow(
            key=key,
            value=own.get(key, ABSENT),
            differs_from=sum(other.get(key, ABSENT) != own.get(key, ABSENT) for other in flat_others),
            others=len(flat_others),
        )
        for key in keys
    ]


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[DiffRow]:
    flat_a, flat_b = flatten(a), flatten(b)
    return [
        DiffRow(key, flat_a.get(key, ABSENT), flat_b.get(key, ABSENT)) for key in sorted({*flat_a, *flat_b})
    ]
