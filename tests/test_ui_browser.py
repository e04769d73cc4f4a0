"""The audit page in a real browser (Debian's Chromium, driven by Playwright): log in, list and filter records, open
one, replay it and see it reproduced, replay a diverging one and see the first divergent token highlighted, run a
probe, open a study's report (on the page and as the file the command wrote), replay a slice, and see prompts and answers that carry markup printed as text. Screenshots land in test-artifacts/ui/.

One proxy and one browser serve the whole module; each test has a browser context (cookies) of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from proxy.commands.cli import main as stackpin
from tests.support.ui_site import ARTIFACTS, KEYS, UPSTREAM_KEY, XSS_PROMPT, Site, chromium, run_site

playwright_api = pytest.importorskip("playwright.sync_api")
Page = playwright_api.Page


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    yield from run_site(tmp_path_factory.mktemp("ui"))


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    executable = chromium()
    with playwright_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser: object, request: pytest.FixtureRequest) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1440, "height": 900})  # type: ignore[attr-defined]
    opened = context.new_page()
    problems: list[str] = []
    opened.on(
        "dialog", lambda dialog: (problems.append(f"a dialog opened: {dialog.message}"), dialog.dismiss())
    )
    opened.on("pageerror", lambda error: problems.append(f"script error: {error}"))
    # An error status (a refused login, another tenant's record) is a console message too; scripts are not.
    opened.on(
        "console",
        lambda m: (
            problems.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    yield opened
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    opened.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
    context.close()
    assert not problems, "the page ran script it should not have, or broke: " + "; ".join(problems)


def log_in(page: Page, site: Site, tenant: str = "acme", then: str = "/ui/") -> None:
    page.goto(site.url + then)
    page.fill("#key", KEYS[f"STACKPIN_KEY_{tenant.upper()}"])
    page.click("form[action='/ui/login'] button[type=submit]")
    page.wait_for_load_state()


def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_a_tenant_logs_in_with_its_key_and_lists_only_its_own_records(site: Site, page: Page) -> None:
    mine = [site.ask("acme", f"Tell me about the sea, part {i}.") for i in range(3)]
    theirs = site.ask("globex", "A secret of globex.")

    page.goto(site.url + "/ui/")
    assert page.url.startswith(site.url + "/ui/login"), "the page needs a login when tenants are configured"
    page.fill("#key", "sk-not-a-key")
    page.click("form[action='/ui/login'] button[type=submit]")
    assert "That key is not known here." in page.inner_text("main")
    shot(page, "login_refused")
    log_in(page, site)
    assert page.url == site.url + "/ui/"
    listed = page.inner_text("#records")
    assert all(record in listed for record in mine) and theirs not in listed
    assert page.inner_text("#counts").startswith(f"{len(site.records['acme'])} records match")

    cookie = next(c for c in page.context.cookies() if c["name"] == "stackpin_ui")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    html = page.content()
    assert all(key not in html and key not in cookie["value"] for key in (*KEYS.values(), UPSTREAM_KEY))
    page.goto(f"{site.url}/ui/records/{theirs}")
    assert "no record" in page.inner_text("main"), "another tenant's record is not found, as on the API"


def test_filters_narrow_the_list_by_stack_prefix_model_and_replays(site: Site, page: Page) -> None:
    on_default = site.ask("acme", "Which stack am I on?", stackpin={"kernel_mode": "default"})
    on_invariant = site.ask("acme", "And now?")
    log_in(page, site)

    page.fill("input[name=stack]", site.other.fingerprint[:8])
    page.click("form.filters button[type=submit]")
    listed = page.inner_text("#records")
    assert on_default in listed and on_invariant not in listed
    assert f"stack={site.other.fingerprint[:8]}" in page.url
    shot(page, "filtered_by_stack")

    page.goto(site.url + "/ui/?model=no-such-model")
    assert "No record matches." in page.inner_text("#records")
    page.goto(site.url + "/ui/?stack=XYZ")
    assert "lowercase hex" in page.inner_text(".problems")

    page.goto(site.url + "/ui/")
    page.check("input[name=replays]")
    page.click("form.filters button[type=submit]")
    assert on_default not in page.inner_text("#records"), "replays only lists replays"


def test_a_record_shows_its_request_answer_tokens_stack_and_entries(site: Site, page: Page) -> None:
    record_id = site.ask("acme", "Describe the harbour.", max_tokens=6, logprobs=True)
    log_in(page, site, then=f"/ui/records/{record_id}")

    assert "Describe the harbour." in page.inner_text("#request")
    answer = site.call(site.harness.proxy.store.get_record(record_id, "acme"))
    assert answer is not None
    text = answer.entries[0].content["response"]["choices"][0]["message"]["content"]
    assert page.inner_text("#answer .answer-text") == text
    assert page.locator("#tokens tbody tr").count() == 6
    assert page.locator("#stack tr.distinct td.key").all_inner_texts() == ["kernel_mode"], (
        "what distinguishes the stack from the other live one is highlighted"
    )
    assert "every entry recomputes" in page.inner_text("#entries")
    assert "temperature" in page.inner_text("#decoding")
    shot(page, "record")


def test_a_replay_from_the_page_is_reproduced(site: Site, page: Page) -> None:
    record_id = site.ask("acme", "Replay me, please.")
    log_in(page, site, then=f"/ui/records/{record_id}")

    page.click("#replay button[type=submit]")
    page.wait_for_url("**/diff")
    assert page.inner_text("#verdict .word") == "reproduced"
    shot(page, "replay_reproduced")
    page.goto(f"{site.url}/ui/records/{record_id}")
    assert "reproduced" in page.inner_text("#replays")


def test_a_diverging_replay_highlights_the_first_divergent_token(site: Site, page: Page) -> None:
    record_id = site.ask("acme", "This one will come back otherwise.", max_tokens=10)
    log_in(page, site, then=f"/ui/records/{record_id}")

    site.replica.diverge_from = 4
    try:
        page.click("#replay button[type=submit]")
        page.wait_for_url("**/diff")
    finally:
        site.replica.diverge_from = None
    assert page.inner_text("#verdict .word") == "diverged"
    assert page.inner_text("#position") == "4"
    for tail in ("#original-tail", "#replayed-tail"):
        divergent = page.locator(f"{tail} .tok.diverged")
        assert divergent.count() == 1 and divergent.locator("small").inner_text() == "4"
    assert page.locator("#prefix .tok.same").count() == 4, "the common prefix is the four tokens before it"


def test_a_replay_on_another_live_stack_chosen_from_the_list(site: Site, page: Page) -> None:
    record_id = site.ask("acme", "Same question, other stack.")
    log_in(page, site, then=f"/ui/records/{record_id}")

    page.select_option("#replay select[name=on]", site.other.fingerprint)
    page.click("#replay button[type=submit]")
    page.wait_for_url("**/diff")
    assert "(another stack)" in page.inner_text(".strip")


def test_a_probe_counts_distinct_answers_and_charts_where_they_diverged(site: Site, page: Page) -> None:
    log_in(page, site, then="/ui/probe")
    page.fill("input[name=pin]", "kernel_mode=batch_invariant")
    page.fill("input[name=requests]", "8")
    page.fill("input[name=concurrency]", "4")
    page.click("form[action='/ui/probe'] button[type=submit]")
    assert page.inner_text("#distinct-completions") == "1" and page.inner_text("#distinct-bitwise") == "1"

    site.replica.nondeterministic = True
    try:
        page.click("form[action='/ui/probe'] button[type=submit]")
        page.wait_for_load_state()
    finally:
        site.replica.nondeterministic = False
    assert page.inner_text("#distinct-completions") == "1", "the fake perturbs logprob bits, not tokens"
    assert int(page.inner_text("#distinct-bitwise")) > 1
    assert page.locator("#chart svg g").count() == int(page.inner_text("#distinct-bitwise"))
    assert "bits at token" in page.inner_text("#variants")


def test_prompts_and_answers_that_carry_markup_are_printed_as_text(site: Site, page: Page) -> None:
    record_id = site.ask("acme", XSS_PROMPT, max_tokens=12)
    log_in(page, site, then=f"/ui/records/{record_id}")

    assert XSS_PROMPT in page.inner_text("#request")
    answer = page.inner_text("#answer .answer-text")
    assert "<script>" in answer or "onmouseover" in answer or "<img" in answer
    for where in (f"/ui/records/{record_id}", "/ui/", "/ui/stacks"):
        page.goto(site.url + where)
        injected = page.locator("main script, main img, main [onmouseover], main [onerror]")
        assert injected.count() == 0, f"{where}: model output became markup"
    site.replica.diverge_from = 1
    try:
        page.goto(f"{site.url}/ui/records/{record_id}")
        page.click("#replay button[type=submit]")
        page.wait_for_url("**/diff")
    finally:
        site.replica.diverge_from = None
    assert page.locator("main script, main img, main [onmouseover], main [onerror]").count() == 0
    assert XSS_PROMPT not in page.content(), "the prompt's markup never reaches the HTML unescaped"
    shot(page, "xss_diff")


def test_logging_out_ends_the_session(site: Site, page: Page) -> None:
    log_in(page, site)
    page.click("header form[action='/ui/logout'] button")
    page.goto(site.url + "/ui/")
    assert page.url.startswith(site.url + "/ui/login")


def test_an_operator_sees_every_tenant_and_filters_by_tenant(site: Site, page: Page) -> None:
    theirs = site.ask("globex", "Only globex and operators read this.")
    log_in(page, site, tenant="ops")
    assert "operator" in page.inner_text("header")
    page.fill("input[name=tenant]", "globex")
    page.click("form.filters button[type=submit]")
    listed = page.inner_text("#records")
    assert theirs in listed and all(record not in listed for record in site.records.get("acme", []))


def test_the_stacks_page_lists_live_stacks_replicas_and_diffs_two_stacks(site: Site, page: Page) -> None:
    log_in(page, site, then="/ui/stacks")
    live = page.inner_text("#live")
    assert site.replica.fingerprint[:12] in live and site.other.fingerprint[:12] in live
    assert page.locator("#replicas .badge.ok").count() == 2, "both replicas are in rotation"
    assert page.locator("#diff tr.differs td.key").all_inner_texts() == ["kernel_mode"]


def test_a_study_run_against_the_proxy_is_read_back_from_the_log_as_its_report(
    site: Site, page: Page, browser: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name a colour.\nSay hello.\nCount to three.\n" + XSS_PROMPT + "\n")
    monkeypatch.setenv("STUDY_KEY", KEYS["STACKPIN_KEY_ACME"])
    args = ["study", str(prompts), "--url", site.url, "--api-key-env", "STUDY_KEY", "--model", "fake-model",
            "--max-tokens", "6", "-n", "6", "--load", "2", "--pin", "kernel_mode=batch_invariant",
            "--compare", "kernel_mode=default", "--out", str(tmp_path / "study")]  # fmt: skip
    site.other.nondeterministic = True
    try:
        with ThreadPoolExecutor(1) as thread:  # the command runs its own event loop, away from Playwright's
            assert thread.submit(stackpin, args).result(timeout=120) == 0
    finally:
        site.other.nondeterministic = False
    study = json.loads((tmp_path / "study" / "study.json").read_text())["study"]

    page.goto((tmp_path / "study" / "report.html").as_uri())  # the file the command wrote, opened on its own
    assert page.inner_text("#side-a .rate") == "0/4" and page.inner_text("#side-b .bits-rate") == "4/4"
    assert page.locator("#rates svg g.row").count() == 2 and page.locator("#map svg rect.cell").count() == 8
    assert page.locator("main script, main img, main [onmouseover], main [onerror]").count() == 0
    shot(page, "study_file")

    log_in(page, site, then="/ui/studies")
    page.fill("input[name=study]", study)
    page.click("form[action='/ui/studies'] button[type=submit]")
    page.wait_for_url(f"**/ui/studies/{study}")
    assert page.inner_text("#side-a .rate") == "0/4" and page.inner_text("#side-b .rate") == "0/4"
    assert page.inner_text("#side-b .bits-rate") == "4/4", "the fake default stack flips bits"
    assert page.locator("#rates svg g.row").count() == 2 and page.locator("#by-load tbody tr").count() == 2
    assert (
        page.locator("#map svg rect.cell.same").count() == 4
        and page.locator("#map svg rect.cell.bits").count() == 4
    )
    assert page.locator("main script, main img, main [onmouseover], main [onerror]").count() == 0
    shot(page, "study")
    page.locator("#map svg rect.cell.bits").first.click()
    assert page.url.endswith("#prompt-0")
    page.locator("#prompt-0 a.mono").first.click()
    page.wait_for_url("**/ui/records/rec_*")
    assert "Name a colour." in page.inner_text("#request")

    other = browser.new_context()  # type: ignore[attr-defined]
    try:
        theirs = other.new_page()
        log_in(theirs, site, tenant="globex", then=f"/ui/studies/{study}")
        assert "No answer of this study was found" in theirs.inner_text("#no-answers"), (
            "acme's study, not theirs"
        )
    finally:
        other.close()
    page.goto(site.url + "/ui/studies/not-a-study")
    assert "is not a study id" in page.inner_text(".problems")


def test_a_slice_replayed_from_the_page_is_gated_by_its_requirement(site: Site, page: Page) -> None:
    before = site.call(_now())
    for k in range(3):
        site.ask("acme", f"Slice question {k}.")
    theirs = site.ask("globex", "Not in acme's slice.")
    log_in(page, site, then="/ui/replays")
    page.fill("input[name=since]", before)
    page.click("form[action='/ui/replays'] button[type=submit]")
    assert page.inner_text("#slice-verdict .word") == "met"
    assert page.inner_text("#level-identical .count") == "3", "acme's three records, not globex's"
    shot(page, "slice_met")

    page.select_option("select[name=on]", site.other.fingerprint)
    page.fill("input[name=require]", "same_text>=0.9")
    page.click("form[action='/ui/replays'] button[type=submit]")
    assert page.inner_text("#slice-verdict .word") == "not met"
    assert page.inner_text("#level-diverged .count") == "3", "the other stack's words differ from these"
    assert page.locator("#divergences tbody tr").count() == 3
    shot(page, "slice_not_met")
    page.locator("#divergences tbody tr a[href$='/diff']").first.click()
    page.wait_for_url("**/diff")
    assert page.inner_text("#verdict .word") == "diverged"
    assert theirs not in page.content()

    page.goto(site.url + "/ui/replays")
    page.fill("input[name=since]", "yesterday")
    page.click("form[action='/ui/replays'] button[type=submit]")
    assert "is not a time" in page.inner_text(".problems")


async def _now() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S")
