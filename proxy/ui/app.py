"""The audit page's sub-application, mounted at /ui by create_app: its middlewares, routes and login.

Middlewares, outermost first: `pages` (errors as HTML pages, security headers on everything), then `guard`
(proxy/ui/security.py: the session cookie, Host, CSRF, who is looking). The pages read the
proxy's own state (its keys, proxy/app_keys.py) through the parent application; they hold none of their own.
"""

from __future__ import annotations

import secrets
from typing import Any

import structlog
from aiohttp import web

from proxy.audit import StoreUnavailable
from proxy.config import Secrets, Settings
from proxy.errors import ReplicaRejected, StackpinError
from proxy.ui import probe_page, records_page, slice_page, stacks_page, study_page
from proxy.ui.render import STATIC, TEMPLATES, environment, render
from proxy.ui.security import COOKIES, CSRF_FIELD, GUARD, VIEWER, Guard, Handler, guard, harden, safe_next
from proxy.ui.session import SESSION, SessionCookies

log = structlog.get_logger("stackpin.ui")


def ui_app(settings: Settings, secrets: Secrets) -> web.Application:
    app = web.Application(middlewares=[pages, guard])
    app[TEMPLATES] = environment()
    app[GUARD] = Guard.of(settings, secrets)
    app[COOKIES] = SessionCookies.of(settings, secrets)
    app.add_routes(
        [
            web.get("", to_records),
            web.get("/", records_page.records),
            web.get("/login", login_form),
            web.post("/login", login),
            web.post("/logout", logout),
            web.get("/records/{record_id}", records_page.record),
            web.post("/records/{record_id}/replay", records_page.replay_record),
            web.get("/records/{record_id}/diff", records_page.diff),
            web.get("/stacks", stacks_page.stacks),
            web.get("/probe", probe_page.probe_form),
            web.post("/probe", probe_page.probe),
            web.get("/replays", slice_page.slice_form),
            web.post("/replays", slice_page.slice_replay),
            web.get("/studies", study_page.studies),
            web.get("/studies/{study_id}", study_page.study),
            web.static("/static", STATIC),
        ]
    )
    return app


@web.middleware
async def pages(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            harden(request, e)
            raise
        response = _error_page(request, e.status, e.text if e.text and e.text != e.reason else e.reason)
        response.cookies.update(e.cookies)  # a session the guard saved on the way out
    except ReplicaRejected as e:
        error = e.replica_body.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        response = _error_page(request, e.status, f"the replica refused: {message or e.status}")
    except StackpinError as e:
        response = _error_page(request, e.status, e.message, e.extra.get("live_stacks"))
    except StoreUnavailable:
        response = _error_page(request, 503, "the audit store is unavailable; retry shortly")
        response.headers["Retry-After"] = "1"
    except Exception:
        log.exception("ui_error", path=request.path)
        response = _error_page(request, 500, "the page failed unexpectedly; the error is in the proxy's log")
    harden(request, response)
    return response


def _error_page(
    request: web.Request, status: int, message: str, live_stacks: list[dict[str, Any]] | None = None
) -> web.Response:
    return render(request, "error.html", status=status, status_code=status, message=message, live=live_stacks)


async def to_records(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/ui/")


async def login_form(request: web.Request) -> web.StreamResponse:
    if VIEWER in request or not request.config_dict[GUARD].needs_login:
        raise web.HTTPSeeOther(safe_next(request.query.get("next")))
    return render(request, "login.html", next=safe_next(request.query.get("next")), problem=None)


async def login(request: web.Request) -> web.StreamResponse:
    form = await request.post()
    key, wanted = form.get("key"), safe_next(_text(form.get("next")))
    digest = request.config_dict[GUARD].login(key) if isinstance(key, str) else None
    if digest is None:
        log.info("ui_login_refused")
        return render(request, "login.html", status=401, next=wanted, problem="That key is not known here.")
    session = request[SESSION]
    session.clear()  # a fresh session, with a fresh CSRF token: nothing carries across a login
    session.update(key=digest, **{CSRF_FIELD: secrets.token_urlsafe(32)})
    raise web.HTTPSeeOther(wanted)


async def logout(request: web.Request) -> web.StreamResponse:
    request[SESSION].clear()
    raise web.HTTPSeeOther("/ui/login")


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
