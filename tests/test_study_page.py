"""The study report as a file: one self-contained HTML page (its styles inline, no script, nothing fetched) whose
prompts and answers, written by others, are printed as text."""

from __future__ import annotations

import re
from typing import Any

from proxy.evidence.study import Load, Side
from proxy.evidence.study_report import Shape, StudyTally, study_report
from proxy.ui.study_page import standalone_report

XSS = "<script>alert('label')</script><img src=x onerror=alert(1)>"


def report() -> dict[str, Any]:
    tally = StudyTally()
    body = {"choices": [{"index": 0, "message": {"content": XSS}}], "stackpin": {"token_ids": [1]}}
    tally.add("a", "c2", 0, (200, {"Stackpin-Record": "rec_" + "a" * 32, "Stackpin-Stack": "fp"}, body))
    shape = Shape([Side("a", "kernel_mode=batch_invariant")], [Load(2)], {0: XSS})
    plan = {"prompt_count": 1, "repeats": 1, "loads": ["c2"], "requests": 1, "source": "p.txt"}
    meta = {"study": "st-0123456789ab", "plan": plan, "answered": 1, "complete": True}
    return study_report(tally, shape, meta)


def test_the_file_carries_its_styles_and_no_script_or_remote_reference() -> None:
    html = standalone_report(report())
    assert html.startswith("<!doctype html>") and "<style>" in html and "--bad:" in html
    assert "<script" not in html.replace("&lt;script", "")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "nothing is fetched from elsewhere"
    assert "<link" not in html and "st-0123456789ab" in html
    assert "0/1" in html and "kernel_mode=batch_invariant" in html


def test_what_others_wrote_is_printed_as_text() -> None:
    html = standalone_report(report())
    assert XSS not in html and "&lt;script&gt;alert(&#39;label&#39;)&lt;/script&gt;" in html
    assert "<img" not in html


def test_record_ids_link_to_the_proxys_page_when_it_is_given() -> None:
    assert 'href="http://127.0.0.1:8080/ui/records/rec_' in standalone_report(
        report(), "http://127.0.0.1:8080/ui/records/"
    )
    assert "/ui/records/rec_" not in standalone_report(report()), "without it, ids are printed, not linked"
