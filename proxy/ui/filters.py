"""The records list's query string: filters and page, read into the store's `RecordFilter`. Pure.

Times are UTC: a browser's `datetime-local` field sends no zone, and the page says UTC beside it; a value with a
zone is taken as given. A value that cannot be read is a problem to show beside the form, never a crash.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import ValidationError

from proxy.audit import RecordFilter
from proxy.ui.security import Viewer

PAGE_SIZES = (25, 50, 100, 200)


@dataclass(frozen=True)
class Listing:
    selected: RecordFilter
    limit: int = PAGE_SIZES[1]
    before: str | None = None
    after: str | None = None
    form: dict[str, str] = field(default_factory=dict)  # what the form shows back, as typed
    problems: list[str] = field(default_factory=list)


def listing(query: Mapping[str, str], viewer: Viewer) -> Listing:
    form = {key: query.get(key, "").strip() for key in ("model", "stack", "tenant", "since", "until")}
    form.update({key: "on" if query.get(key) else "" for key in ("replays", "flagged")})
    problems: list[str] = []
    values: dict[str, object] = {
        "model": form["model"] or None,
        "fingerprint": form["stack"].lower() or None,
        "replays_only": bool(form["replays"]),
        "flagged_only": bool(form["flagged"]),
        "tenant": viewer.scope if viewer.scope is not None else (form["tenant"] or None),
    }
    for name in ("since", "until"):
        values[name] = moment(form[name], name, problems)
    try:
        selected = RecordFilter.model_validate(values)
    except ValidationError as e:
        problems.extend(str(error["msg"]).removeprefix("Value error, ") for error in e.errors())
        for error in e.errors():  # the list is shown without the filters it cannot use
            values[str(error["loc"][0])] = None
        selected = RecordFilter.model_validate(values)
    limit = _limit(query.get("limit"))
    form["limit"] = str(limit)
    return Listing(
        selected=selected,
        limit=limit,
        before=query.get("before") or None,
        after=query.get("after") or None,
        form=form,
        problems=problems,
    )


def moment(text: str, name: str, problems: list[str]) -> datetime | None:
    """A time typed into a form (UTC unless it says otherwise), or None with the problem noted."""
    if not text:
        return None
    try:
        read = datetime.fromisoformat(text)
    except ValueError:
        problems.append(f"{name}: {text!r} is not a time like 2026-12-01T09:30 (UTC)")
        return None
    return read if read.tzinfo is not None else read.replace(tzinfo=UTC)


def _limit(text: str | None) -> int:
    try:
        wanted = int(text or PAGE_SIZES[1])
    except ValueError:
        return PAGE_SIZES[1]
    return wanted if wanted in PAGE_SIZES else PAGE_SIZES[1]
