"""The Batch API's pure parts: an input file read and checked, the ids of a batch's records and files, its output
and error lines, the status a job shows as, and the batch's own entry."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from proxy.errors import BadRequest, NotFound
from proxy.state.batch_lines import DoneLine
from proxy.state.batches import (
    batch_entry,
    batch_object,
    batch_record_id,
    create_options,
    line_record_id,
    output_contents,
    output_file_id,
    read_lines,
)
from proxy.state.files import StoredFile
from proxy.state.jobs import Job

T0 = datetime(2026, 12, 3, 4, 5, 6, tzinfo=UTC)
BATCH = "batch_" + "cd" * 16
CHAT = "/v1/chat/completions"


def line(custom_id: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"messages": [{"role": "user", "content": "hi"}], **body}})  # fmt: skip


def job(**changes: Any) -> Job:
    values: dict[str, Any] = {"id": BATCH, "kind": "batch", "tenant": "t", "state": "queued", "outcome": None,
              "cancel_requested": False, "request": {"endpoint": CHAT, "input_file_id": "file-x", "lines": 3},
              "detail": {}, "created_at": T0, "started_at": None, "finished_at": None, "owner": None,
              "lease_until": None, "attempts": 0}  # fmt: skip
    return Job(**{**values, **changes})


def test_an_input_file_is_read_line_by_line_and_blank_lines_are_skipped() -> None:
    content = f"{line('a')}\n\n{line('b', max_tokens=2)}\n".encode()
    lines = read_lines(content, CHAT, max_lines=10)
    assert [(x.custom_id, x.body.get("max_tokens")) for x in lines] == [("a", None), ("b", 2)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe", "not UTF-8"),
        (b"\n\n", "holds no request"),
        (f"{line('a')}\n{line('a')}".encode(), "line 2: custom_id 'a' appears twice"),
        (b"[1]", "line 1: not a JSON object"),
        (
            json.dumps({"custom_id": "a", "url": CHAT, "body": {}, "method": "GET"}).encode(),
            "method must be POST",
        ),
        (line("a", stream=True).encode(), "neither streamed"),
        ("\n".join(line(str(i)) for i in range(4)).encode(), r"more than 3 requests"),
    ],
)
def test_a_bad_input_file_is_a_400_naming_its_first_bad_line(content: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        read_lines(content, CHAT, max_lines=3)


def test_create_options_are_checked() -> None:
    assert create_options({"input_file_id": "f", "endpoint": CHAT, "completion_window": "24h"}) == (
        "f",
        CHAT,
        {},
    )
    for body, param in (({"endpoint": CHAT}, "input_file_id"), ({"input_file_id": "f", "endpoint": "/v1/x"}, "endpoint"),
                        ({"input_file_id": "f", "endpoint": CHAT, "completion_window": "1h"}, "completion_window"),
                        ({"input_file_id": "f", "endpoint": CHAT, "metadata": {"a": 1}}, "metadata")):  # fmt: skip
        with pytest.raises(BadRequest) as raised:
            create_options(body)
        assert raised.value.param == param


def test_ids_derive_from_the_batch_and_are_distinct() -> None:
    assert batch_record_id(BATCH) == "rec_" + "cd" * 16
    ids = {line_record_id(BATCH, i) for i in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 36 and i.startswith("rec_") for i in ids)
    assert line_record_id(BATCH, 0) == line_record_id(BATCH, 0) != line_record_id("batch_" + "0" * 32, 0)
    assert output_file_id(BATCH, "output") != output_file_id(BATCH, "error")
    with pytest.raises(NotFound):
        batch_record_id("batch_nothex")


def test_answers_go_to_the_output_file_and_errors_to_the_error_file_in_input_order() -> None:
    done = [DoneLine(0, "a", "rec_1", 200, {"ok": 1}), DoneLine(1, "b", None, 409, {"error": {}}),
            DoneLine(2, "c", "rec_3", 200, {"ok": 3})]  # fmt: skip
    answered, failed = output_contents(BATCH, done)
    out = [json.loads(x) for x in answered.decode().splitlines()]
    assert [(x["custom_id"], x["response"]["request_id"]) for x in out] == [("a", "rec_1"), ("c", "rec_3")]
    assert out[0]["id"] == "batch_req_" + line_record_id(BATCH, 0).removeprefix("rec_")
    assert [json.loads(x)["response"]["status_code"] for x in failed.decode().splitlines()] == [409]


def test_a_job_shows_as_the_batch_statuses_openai_names() -> None:
    assert batch_object(job(), (0, 0))["status"] == "validating"
    assert batch_object(job(state="running", started_at=T0), (1, 0))["status"] == "in_progress"
    assert batch_object(job(state="running", cancel_requested=True), (1, 0))["status"] == "cancelling"
    assert batch_object(job(state="running", detail={"finalizing_at": 1}), (1, 0))["status"] == "finalizing"
    ended = batch_object(job(state="finished", outcome="completed", finished_at=T0), (2, 1))
    assert (ended["status"], ended["completed_at"], ended["request_counts"]) == (
        "completed", int(T0.timestamp()), {"total": 3, "completed": 2, "failed": 1},
    )  # fmt: skip


def test_the_batch_entry_names_every_line_s_record_and_its_files_by_sha256() -> None:
    stored = StoredFile("file-x", "t", "batch", "in.jsonl", 10, "ab" * 32, T0)
    done = [DoneLine(0, "a", "rec_1", 200, {}), DoneLine(1, "b", None, 400, {})]
    sealed = batch_entry(job(), "completed", stored, [], done, T0)
    assert (sealed.record_id, sealed.part, sealed.status, sealed.tenant) == (
        batch_record_id(BATCH),
        "answer",
        "completed",
        "t",
    )
    content = sealed.content
    assert content["input_file"]["sha256"] == "ab" * 32
    assert [x["record"] for x in content["lines"]] == ["rec_1", None]
