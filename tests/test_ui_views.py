"""The audit page's pure layer: what a record's answer shows, a stack's distinguishing keys and two stacks' diff,
a replay's token diff, the list's filters, and the probe chart's geometry."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.audit import AuditRecord, EntryView
from proxy.evidence.answers import Tokens
from proxy.evidence.probe import ProbeResult, Variant
from proxy.ui.answer import answer_body, answer_view
from proxy.ui.chart import chart
from proxy.ui.filters import listing
from proxy.ui.record import record_view
from proxy.ui.security import Guard, Viewer, host_is_loopback, safe_next
from proxy.ui.stackdiff import diff, distinguish
from proxy.ui.tokendiff import Side, replay_diff
from tests.support.audit_databases import KINDS
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import running_proxy

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def record(*entries: tuple[str, str, dict[str, Any]]) -> AuditRecord:
    views = [
        EntryView(
            seq=i + 1,
            index=i,
            part=part,  # type: ignore[arg-type]
            created_at=T0,
            status=status,
            replica="r0",
            model="m",
            fingerprint="a" * 64,
            content=content,
            sha256="0" * 64,
            stack_declared=False,
        )
        for i, (part, status, content) in enumerate(entries)
    ]
    return AuditRecord(
        id="rec_x",
        tenant="acme",
        created_at=T0,
        model="m",
        fingerprint="a" * 64,
        replica="r0",
        replay_of=None,
        status=entries[-1][1],
        stack={"model": "m"},
        stack_declared=False,
        prompt_sha256=None,
        prompt_text=None,
        entries=views,
        flags=[],
    )


def test_every_choice_tool_call_and_refusal_of_the_stored_body_is_shown() -> None:
    body = {
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Paris."}},
            {
                "index": 1,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "refusal": "I would rather not.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "geo", "arguments": '{"q":1}'},
                        }
                    ],
                    "audio": {"id": "a1"},
                },
            },
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        "stackpin": {"token_ids": [5, 6], "token_logprobs": [-0.5, -0.0], "batch": {"max": 2}, "seed": 7},
    }
    view = answer_view(body)
    assert [c.content for c in view.choices] == ["Paris.", None]
    second = view.choices[1]
    assert second.refusal == "I would rather not." and second.other == {"audio": {"id": "a1"}}
    assert [(t.id, t.name, t.arguments) for t in second.tool_calls] == [("call_1", "geo", '{"q":1}')], (
        "tool call arguments are shown exactly as the replica sent them"
    )
    assert [(t.token_id, t.bits) for t in view.tokens] == [(5, (-0.5).hex()), (6, "0x0.0p+0")]
    assert (view.batch, view.seed) == ({"max": 2}, 7)


def test_a_streamed_record_shows_what_its_closed_entry_assembled() -> None:
    opened = {"endpoint": "/v1/chat/completions", "request": {"messages": [], "seed": 3}, "stream": True}
    closed = {
        "tokens": {
            "text": "Hi there",
            "finish_reason": "length",
            "token_ids": [1, 2],
            "token_logprobs": [-1, -2],
        },
        "usage": None,
        "closed_at": "2026-12-01T09:00:01+00:00",
    }
    view = record_view(record(("opened", "streaming", opened), ("closed", "complete", closed)))
    assert view.stream and view.seed == 3 and not view.seed_drawn
    assert view.answer is not None and view.answer.choices[0].content == "Hi there"
    assert [t.token_id for t in view.answer.tokens] == [1, 2]
    assert answer_body(record(("opened", "streaming", opened))) is None, "an open stream has no answer yet"


def test_a_stack_is_marked_where_it_differs_from_the_other_live_stacks() -> None:
    mine = {"model": "m", "kernel_mode": "batch_invariant", "software": {"torch": "2.13.0", "cuda": None}}
    others = [{**mine, "kernel_mode": "default"}, {**mine, "software": {"torch": "2.11.0", "cuda": None}}]
    rows = {row.key: (row.value, row.differs_from) for row in distinguish(mine, others)}
    assert rows == {
        "kernel_mode": ("batch_invariant", 1),
        "model": ("m", 0),
        "software.cuda": ("null", 0),
        "software.torch": ("2.13.0", 1),
    }
    changed = [row.key for row in diff(mine, {**mine, "batching": {"kv_split_size": 128}}) if not row.same]
    assert changed == ["batching.kv_split_size"]


def side(ids: list[int], logprobs: list[float], text: str) -> Side:
    return Side(Tokens(text=text, token_ids=ids, token_logprobs=logprobs))


def test_a_token_divergence_shows_the_common_prefix_and_both_continuations() -> None:
    original = side([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0], "a b c d")
    replayed = side([1, 2, 9, 4], [-1.0, -2.0, -3.0, -4.0], "a b z d")
    comparison = {"outcome": "diverged", "compared": "tokens", "position": 2, "reason": "token"}
    shown = replay_diff(comparison, original, replayed)
    assert [c.token_id for c in shown.prefix] == [1, 2] and shown.identical_tokens == 2
    assert [(c.token_id, c.state) for c in shown.original_tail] == [(3, "diverged"), (4, "same")]
    assert [(c.token_id, c.state) for c in shown.replayed_tail] == [(9, "diverged"), (4, "same")]
    assert (shown.text_prefix, shown.original_text, shown.replayed_text) == ("a b ", "c d", "z d")
    assert shown.bits_rows == [], "past a token divergence, bits are not compared"


def test_a_bits_divergence_puts_the_logprob_bits_side_by_side_with_the_differing_digits() -> None:
    a = -0.25
    b = float.fromhex((-0.25).hex().replace("0x1.0000000000000p", "0x1.0000000000001p"))
    original, replayed = side([1, 2], [-1.0, a], "x y"), side([1, 2], [-1.0, b], "x y")
    comparison = {"outcome": "diverged", "compared": "tokens", "position": 1, "reason": "logprob"}
    (row,) = replay_diff(comparison, original, replayed).bits_rows
    assert (row.position, row.original, row.replayed) == (1, a, b)
    assert [d.char for d in row.original_bits if d.differs] == ["0"]
    assert [d.char for d in row.replayed_bits if d.differs] == ["1"]


def test_a_reproduced_replay_shows_every_token_as_common() -> None:
    same = side([1, 2, 3], [-1.0, -2.0, -3.0], "a b c")
    shown = replay_diff({"outcome": "reproduced", "compared": "tokens"}, same, same)
    assert shown.identical_tokens == 3 and len(shown.prefix) == 3 and not shown.original_tail


def test_a_divergence_beside_identical_tokens_is_placed_where_the_comparison_says() -> None:
    same = side([1, 2, 3], [-1.0, -2.0, -3.0], "")
    comparison = {"outcome": "diverged", "compared": "tokens", "part": "choice 1", "choice": 1,
                  "field": "message.tool_calls[0].function.arguments", "position": 11, "reason": "text"}  # fmt: skip
    shown = replay_diff(comparison, same, same)
    assert shown.unit == "choice 1, field message.tool_calls[0].function.arguments, character"
    assert shown.position == 11 and shown.identical_tokens == 3
    assert not shown.original_tail and not shown.bits_rows, "no token diverged: none is laid out as if it had"


def test_the_lists_filters_read_utc_times_and_keep_a_tenant_to_its_own_records() -> None:
    tenant, operator = Viewer("acme", operator=False), Viewer("ops", operator=True)
    query = {"since": "2026-12-01T09:30", "stack": "9A41", "tenant": "globex", "replays": "on", "limit": "7"}
    read = listing(query, tenant)
    assert read.selected.since == datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    assert read.selected.fingerprint == "9a41" and read.selected.replays_only
    assert read.selected.tenant == "acme", "a tenant's filter never names another tenant"
    assert read.limit == 50 and read.problems == []
    assert listing(query, operator).selected.tenant == "globex"
    bad = listing({"stack": "zz", "until": "yesterday"}, operator)
    assert len(bad.problems) == 2 and bad.selected.fingerprint is None


def test_a_text_filter_no_record_could_match_is_a_problem_naming_it_and_is_left_out() -> None:
    read = listing({"model": "a\x00b", "stack": "zz"}, Viewer("ops", operator=True))
    assert sorted(p.split(" ", 1)[0] for p in read.problems) == ["a", "model"], "the field named, or its own"
    assert read.selected.model is None and read.selected.fingerprint is None


@pytest.mark.parametrize("kind", KINDS)
async def test_the_records_page_answers_a_filter_it_cannot_use_with_a_400_naming_it(
    kind: str, replica: FakeReplica, tmp_path: Path
) -> None:
    async with (
        running_proxy([replica], tmp_path, store=kind) as harness,
        aiohttp.ClientSession() as session,
        session.get(f"{harness.url}/ui/", params={"model": "a\x00b"}) as page,
    ):
        assert page.status == 400, "the caller's to fix, not the store down"
        assert "model must be 1 to 200 characters of text without NUL characters" in await page.text()


def test_the_guards_decisions() -> None:
    guard = Guard({"h" * 64: "acme", "o" * 64: "ops"}, frozenset({"ops"}))
    assert guard.viewer_for("h" * 64) == Viewer("acme", operator=False)
    assert guard.viewer_for("o" * 64) == Viewer("ops", operator=True)
    assert guard.viewer_for(None) is None and guard.login("") is None
    assert Guard({}, frozenset()).viewer_for(None) == Viewer("local", operator=False)
    assert [host_is_loopback(h) for h in ("127.0.0.1:8080", "localhost", "[::1]:80", "evil.example")] == [
        True,
        True,
        True,
        False,
    ]
    assert [safe_next(p) for p in ("/ui/stacks", "//evil", "/ui//evil", "https://x/ui/", None)] == [
        "/ui/stacks",
        "/ui/",
        "/ui/",
        "/ui/",
        "/ui/",
    ]


def test_the_chart_scales_bars_to_the_most_common_answer_and_marks_where_each_left_it() -> None:
    reference = Variant(Tokens(text="", token_ids=[1, 2, 3, 4]), count=6)
    other = Variant(
        Tokens(text="", token_ids=[1, 2, 9, 9]), count=3, completion=1, diverges_at=2, reason="token"
    )
    bits = Variant(Tokens(text="", token_ids=[1, 2, 3, 4]), count=1, diverges_at=3, reason="logprob")
    drawn = chart(ProbeResult(10, 2, [reference, other, bits], ["s"], {}))
    first, second, third = drawn.rows
    assert first.kind == "reference" and second.kind == "token" and third.kind == "bits"
    assert second.bar == first.bar / 2 and second.same == first.same / 2 == second.rest
    assert third.mark > 0 and third.rest == 0
