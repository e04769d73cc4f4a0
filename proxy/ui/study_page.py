"""The study report, in two forms: a page of the audit UI (`/ui/studies/{id}`), read from the log, and a
self-contained HTML file that `stackpin study` writes beside its JSON, to open anywhere or send.

The page finds the study's answers by their tags among the records of the viewer's scope from `since` (and up to
`until`), as a study that continues does (proxy/evidence/study_log.py), so what it shows is what the log holds,
whoever ran the study and whether or not it finished. Both forms render one template (`study_body.html`) over the
report's JSON and the charts' geometry (proxy/ui/study_chart.py); the file carries the page's own style sheet and
no script.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from aiohttp import web
from markupsafe import Markup

from proxy.app_keys import STORE
from proxy.evidence.study import valid_study_id
from proxy.evidence.study_log import read_study
from proxy.evidence.study_report import headline, study_report
from proxy.ui.filters import moment
from proxy.ui.render import STATIC, environment, render
from proxy.ui.security import VIEWER
from proxy.ui.study_chart import forest, histograms, prompt_maps

DEFAULT_WINDOW = timedelta(days=1)


def report_context(report: dict[str, Any], record_link: str) -> dict[str, Any]:
    """What study_body.html draws: the report, its charts, and where a record id links to."""
    return {
        "report": report,
        "headlines": {side["key"]: headline(side) for side in report["sides"]},
        "forest": forest(report),
        "histograms": histograms(report),
        "maps": prompt_maps(report),
        "record_link": record_link,
    }


def standalone_report(report: dict[str, Any], record_link: str = "") -> str:
    """The report as one HTML file: its styles inline, no script, nothing fetched. `record_link` prefixes a record
    id to link it (the proxy's /ui/records/); empty: ids are printed, not linked."""
    template = environment().get_template("study_file.html")
    # The page's own style sheet, never data: it is the one value printed unescaped.
    styles = Markup((STATIC / "ui.css").read_text(encoding="utf-8"))
    return template.render(styles=styles, **report_context(report, record_link))


async def studies(request: web.Request) -> web.StreamResponse:
    """A form that opens a study by its id; a filled one goes to its page."""
    study = request.query.get("study", "").strip()
    if study:
        if not valid_study_id(study):
            return render(
                request, "studies.html", status=400, form=dict(request.query), problems=[_not_an_id(study)]
            )
        query = {key: request.query[key] for key in ("since", "until") if request.query.get(key)}
        raise web.HTTPSeeOther(f"/ui/studies/{study}" + (f"?{urlencode(query)}" if query else ""))
    return render(request, "studies.html", form={}, problems=[])


async def study(request: web.Request) -> web.Response:
    study_id = request.match_info["study_id"]
    problems: list[str] = []
    since = moment(request.query.get("since", "").strip(), "since", problems)
    until = moment(request.query.get("until", "").strip(), "until", problems)
    form = {
        "study": study_id,
        "since": request.query.get("since", ""),
        "until": request.query.get("until", ""),
    }
    if not valid_study_id(study_id):
        problems.insert(0, _not_an_id(study_id))
    if problems:
        return render(request, "studies.html", status=400, form=form, problems=problems)
    since = since or datetime.now(UTC) - DEFAULT_WINDOW
    found = await read_study(
        request.config_dict[STORE], study_id, since=since, until=until, tenant=request[VIEWER].scope
    )
    report = study_report(
        found.tally,
        found.shape(),
        {
            "study": study_id,
            "first_answer": found.first.isoformat() if found.first else None,
            "last_answer": found.last.isoformat() if found.last else None,
            "answered": sum(found.tally.done().counts.values()),
            "records_read": found.read,
            "since": since.isoformat(),
            "until": until.isoformat() if until else None,
        },
    )
    return render(request, "study.html", **report_context(report, "/ui/records/"))


def _not_an_id(text: str) -> str:
    return f"study: {text[:40]!r} is not a study id (st- and 12 hex digits)"
