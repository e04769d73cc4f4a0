"""Reading one key of a checkpoint's config.json, checked: the error type every config problem raises, and the
readers that name the file and the key when a value is missing or of the wrong kind.

It knows nothing of which keys a model family needs (families.py) or of weight files (checkpoint.py).
"""

from __future__ import annotations

import math
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint folder is missing a file, or a file in it is malformed. The message names the file."""


def require(raw: dict[str, Any], key: str, kind: type, where: str) -> Any:
    """`raw[key]` as `kind` (int: a positive integer; float: a finite number; bool: true or false)."""
    if key not in raw:
        raise CheckpointError(f"{where}: missing key {key!r}")
    value = raw[key]
    if kind is bool:
        if not isinstance(value, bool):
            raise CheckpointError(f"{where}: {key!r} must be true or false, got {value!r}")
        return value
    # bool is an int in Python; a config that says `"hidden_size": true` is still wrong.
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise CheckpointError(f"{where}: {key!r} must be an integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise CheckpointError(f"{where}: {key!r} must be a number, got {value!r}")
    if kind is float and not math.isfinite(value):
        raise CheckpointError(f"{where}: {key!r} must be finite, got {value!r}")
    if kind is int and value <= 0:
        raise CheckpointError(f"{where}: {key!r} must be positive, got {value!r}")
    return kind(value)


def optional(raw: dict[str, Any], key: str, kind: type, where: str, default: Any) -> Any:
    """`require`, or `default` where the key is absent or null."""
    return default if raw.get(key) is None else require(raw, key, kind, where)


def positive(raw: dict[str, Any], key: str, where: str, default: float | None) -> float | None:
    """A finite number above zero, or `default` where the key is absent or null."""
    value = optional(raw, key, float, where, default)
    if value is not None and value <= 0:
        raise CheckpointError(f"{where}: {key!r} must be positive, got {value!r}")
    return value


def layer_set(raw: dict[str, Any], key: str, layers: int, where: str) -> frozenset[int]:
    """A list of layer indices, each below `layers`."""
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in value
    ):
        raise CheckpointError(f"{where}: {key!r} must be a list of layer indices below {layers}")
    return frozenset(value)


def flags(raw: dict[str, Any], key: str, layers: int, where: str) -> list[bool] | None:
    """A list of one 0/1 (or true/false) per layer, or None where the key is absent or null."""
    value = raw.get(key)
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != layers
        or not all(v in (0, 1) and not isinstance(v, float) for v in value)
    ):
        raise CheckpointError(f"{where}: {key!r} must be a list of {layers} zeros and ones, one per layer")
    return [bool(v) for v in value]


def count(raw: dict[str, Any], key: str, where: str) -> int:
    """A non-negative integer, 0 where absent or null."""
    value = raw.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value
