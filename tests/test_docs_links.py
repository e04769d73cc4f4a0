"""The documentation's links lead somewhere: every relative link in README.md, docs/*.md and bench/README.md names
a file of this tree (and, with a `#fragment`, a heading of it), and every `bench/results/...` path they quote exists.

Links to other sites are not followed; fenced code blocks are not read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
RESULTS_PATH = re.compile(r"`(bench/results/[^`\s]+)`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(page: Path) -> str:
    return FENCE.sub("", page.read_text())


def anchors(page: Path) -> set[str]:
    """The fragment ids GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading numbered from -1."""
    seen: dict[str, int] = {}
    ids = set()
    for title in HEADING.findall(prose(page)):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


def relative_links(page: Path) -> list[str]:
    return [
        target
        for target in INLINE_LINK.findall(prose(page))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


def broken(page: Path, target: str) -> str | None:
    path, _, fragment = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return f"{target}: no such file"
    if fragment and file.suffix == ".md" and fragment not in anchors(file):
        return f"{target}: no heading #{fragment} in {file.name}"
    return None


def test_the_pages_are_found() -> None:
    assert ROOT / "README.md" in PAGES and len(PAGES) > 3, "README.md, bench/README.md and docs/*.md are read"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    faults = [fault for target in relative_links(page) if (fault := broken(page, target))]
    assert not faults, f"{page.relative_to(ROOT)} links to what is not there:\n" + "\n".join(faults)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_results_file_exists(page: Path) -> None:
    missing = sorted({path for path in RESULTS_PATH.findall(prose(page)) if not (ROOT / path).exists()})
    assert not missing, f"{page.relative_to(ROOT)} quotes results files that are not there: {missing}"


def test_a_missing_file_and_a_missing_heading_are_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A title\n\n## Routes and records\n\n```\n[not a link](nowhere.md)\n```\n[a site](https://x.org)\n"
    )
    assert relative_links(page) == [], "links in code blocks and to other sites are not checked"
    assert broken(page, "#routes-and-records") is None
    assert broken(page, "page.md#a-title") is None
    assert broken(page, "#missing") == "#missing: no heading #missing in page.md"
    assert broken(page, "other.md") == "other.md: no such file"
