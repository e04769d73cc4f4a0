"""Reading the query strings of the stored-state routes: whole numbers, booleans and list pages, each a 400 naming
the parameter when it is not what it must be. Pure."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.errors import BadRequest

LIST_LIMIT_MAX = 100


def whole(query: Mapping[str, str], name: str, default: int | None = None, *, least: int = 0) -> int | None:
    value = query.get(name)
    if value is None:
        return default
    text = value.removeprefix("-")
    if not text.isascii() or not text.isdigit() or len(text) > 18 or int(value) < least:
        raise BadRequest(f"{name} must be a whole number of at least {least}, got {value[:40]!r}", param=name)
    return int(value)


def flag(query: Mapping[str, str], name: str) -> bool:
    value = query.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise BadRequest(f"{name} must be true or false, got {value[:40]!r}", param=name)
    return value in ("true", "1")


def page_options(query: Mapping[str, str], *, default_order: str = "desc") -> tuple[str | None, int, str]:
    """`after`, `limit` (1 to 100, default 20) and `order` (`asc` or `desc`) of a list request."""
    limit = whole(query, "limit", 20, least=1)
    assert limit is not None
    if limit > LIST_LIMIT_MAX:
        raise BadRequest(f"limit must be from 1 to {LIST_LIMIT_MAX}, got {limit}", param="limit")
    order = query.get("order", default_order)
    if order not in ("asc", "desc"):
        raise BadRequest(f"order must be 'asc' or 'desc', got {order[:40]!r}", param="order")
    return query.get("after"), limit, order
