"""Rendering the audit page: one jinja2 environment over the packaged templates, escaping everything it prints.

Autoescaping is on for every template, and no template marks a value safe: prompts, completions, tool calls and
stack documents are data written by others, and they are printed as text. The few filters here format values
for reading (times in UTC, short fingerprints, JSON); none of them builds markup.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from proxy.stack import short
from proxy.ui.security import CSRF, GUARD, VIEWER

TEMPLATES = web.AppKey("templates", jinja2.Environment)
STATIC = Path(__file__).parent / "static"
HTML = "text/html"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("proxy.ui", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(utc=utc, short=lambda fp: short(fp) if fp else "", pretty=pretty, ms=ms)
    version = static_version()
    env.globals["static"] = lambda name: f"/ui/static/{name}?v={version}"
    return env


def static_version() -> str:
    """A digest of the shipped assets, in their URLs, so that a browser never keeps a stale sheet or script."""
    digest = hashlib.sha256()
    for path in sorted(STATIC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def render(request: web.Request, template: str, *, status: int = 200, **context: Any) -> web.Response:
    """The page, with who is looking (`viewer`, None on the login page) and the form token (`csrf`)."""
    env = request.config_dict[TEMPLATES]
    page = env.get_template(template).render(
        path=request.path,
        viewer=request.get(VIEWER),
        csrf=request.get(CSRF, ""),
        needs_login=request.config_dict[GUARD].needs_login,
        **context,
    )
    return web.Response(text=page, status=status, content_type=HTML, charset="utf-8")


def utc(moment: datetime | str | None, precise: bool = False) -> str:
    if moment is None:
        return ""
    if isinstance(moment, str):
        try:
            moment = datetime.fromisoformat(moment)
        except ValueError:
            return moment
    moment = moment.astimezone(UTC)
    text = moment.strftime("%Y-%m-%d %H:%M:%S.%f")
    return text[:-3] if precise else text[:-7]  # milliseconds, or whole seconds


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def ms(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds * 1000:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"
