"""The values the audit store hands back."""

from __future__ import annotations

from proxy.audit import EntryCheck


def test_an_entry_check_is_ok_only_when_every_part_holds() -> None:
    base = {"seq": 3, "index": 2, "part": "answer", "sha256": "a" * 64}
    assert EntryCheck(**base, recomputes=True, included=True).ok
    assert EntryCheck(**base, recomputes=True, included=None).ok, "not integrated yet is not a failure"
    assert not EntryCheck(**base, recomputes=True, included=False).ok
    assert not EntryCheck(**base, recomputes=False, included=True).ok
