"""Which JSON the proxy accepts from a client: only what the audit log can hold, nested no deeper than it reads.

A record holds the exact request as canonical JSON (RFC 8785), which has no form for integers beyond
±(2**53 - 1), for non-finite numbers (`1e400` reads as infinity) or for lone surrogates (`"\\ud800"`). A body
holding one is refused before any replica is called, naming the field, since its answer could never be recorded
and so never served. Nesting is bounded too, well below the depth at which recursive JSON code fails. Pure
functions; the caller maps `Unrecordable` to its error.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 64
SAFE_INT = 2**53 - 1


class Unrecordable(ValueError):
    """A value the audit log cannot hold; `path` names it as `messages[0].content`, '' for the whole body."""

    def __init__(self, path: str, reason: str) -> None:
        path = path if len(path) <= 200 else path[:200] + "..."
        super().__init__(f"{path or 'the body'} {reason}")
        self.path = path
        self.reason = reason


def check_recordable(value: Any, *, max_depth: int = MAX_DEPTH) -> None:
    """Raises `Unrecordable` for the first value, in document order, that canonical JSON cannot write."""
    # Every request passes here, and almost none holds anything wrong: a walk that names no paths vouches for
    # those, and only a body it cannot vouch for is walked again to find and name its first fault.
    if not _plainly_recordable(value, max_depth):
        _check_each(value, max_depth)


def _check_each(value: Any, max_depth: int) -> None:
    """The full walk: every value in document order, each with its path, the first fault raised."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= max_depth:
                raise Unrecordable(
                    path, f"is nested deeper than {max_depth} levels, the most the proxy reads"
                )
            children = _children(path, item, depth + 1)
            stack.extend(reversed(children))
        elif isinstance(item, str):
            _check_text(path, item)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not -SAFE_INT <= item <= SAFE_INT:
                raise Unrecordable(
                    path, f"is {item}, beyond the integers the audit log holds exactly (±{SAFE_INT})"
                )
        elif isinstance(item, float) and not math.isfinite(item):
            raise Unrecordable(path, "is a number too large for the audit log (it reads as infinity)")


def _plainly_recordable(value: Any, depth_left: int) -> bool:
    """True when `value` holds nothing canonical JSON cannot write (False may be unsure, never wrong)."""
    kind = type(value)
    if kind is dict:
        if depth_left <= 0:
            return False
        for key, item in value.items():
            if type(key) is not str or not (key.isascii() or _is_unicode(key)):
                return False
            if not _plainly_recordable(item, depth_left - 1):
                return False
        return True
    if kind is list:
        if depth_left <= 0:
            return False
        return all(_plainly_recordable(item, depth_left - 1) for item in value)
    if kind is str:
        return value.isascii() or _is_unicode(value)
    if kind is int:
        return -SAFE_INT <= value <= SAFE_INT
    if kind is float:
        return value - value == 0.0  # neither NaN nor an infinity
    return kind is bool or value is None


def _is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate, which has no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _children(path: str, item: dict[str, Any] | list[Any], depth: int) -> list[tuple[str, Any, int]]:
    if isinstance(item, list):
        return [(f"{path}[{i}]", child, depth) for i, child in enumerate(item)]
    children = []
    for key, child in item.items():
        child_path = f"{path}.{key}" if path else key
        _check_text(child_path, key)
        children.append((child_path, child, depth))
    return children


def _check_text(path: str, text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise Unrecordable(
            path.encode("utf-8", "backslashreplace").decode("utf-8"),
            f"holds a lone surrogate (\\u{ord(bad):04x}), which is not Unicode text and cannot be recorded",
        ) from None
