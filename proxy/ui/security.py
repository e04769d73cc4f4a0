"""Who is looking at the audit page, and what protects it.

The page keeps the API's tenant rules (proxy/serving/auth.py): with `[[tenants]]`, a tenant logs in with its API key and
sees only its own records; the tenants named in `[ui] operators` see every tenant's. With no tenants the proxy
listens on loopback only (config refuses otherwise), nobody logs in, and everything belongs to the tenant
`local`; the page then answers only requests whose Host is a loopback name, so that a web page elsewhere cannot
reach it by pointing its own name at 127.0.0.1 (DNS rebinding).

The session (proxy/ui/session.py) holds the SHA-256 of the key that logged in, never the key, and is checked
against the configured tenants on every request, so removing a key from the configuration ends its sessions. Every
POST carries the session's CSRF token, compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets as random_tokens
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from aiohttp import web

from proxy.config import Secrets, Settings
from proxy.serving.auth import LOCAL_TENANT
from proxy.ui.session import SESSION, SessionCookies

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CSRF_FIELD = "csrf"
OPEN_PATHS = ("/ui/login", "/ui/static/")  # reachable without a session
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


@dataclass(frozen=True)
class Viewer:
    tenant: str
    operator: bool

    @property
    def scope(self) -> str | None:
        """The tenant whose records this viewer may read; None: every tenant's."""
        return None if self.operator else self.tenant


VIEWER = web.RequestKey("viewer", Viewer)
CSRF = web.RequestKey("csrf", str)


@dataclass(frozen=True)
class Guard:
    """The page's access rules, as pure decisions over the configuration."""

    tenant_key_hashes: dict[str, str]
    operators: frozenset[str]

    @classmethod
    def of(cls, settings: Settings, secrets: Secrets) -> Guard:
        return cls(dict(secrets.tenant_key_hashes), frozenset(settings.ui.operators))

    @property
    def needs_login(self) -> bool:
        return bool(self.tenant_key_hashes)

    def viewer_for(self, key_sha256: str | None) -> Viewer | None:
        if not self.needs_login:
            return Viewer(LOCAL_TENANT, operator=False)
        tenant = self.tenant_key_hashes.get(key_sha256 or "")
        return None if tenant is None else Viewer(tenant, operator=tenant in self.operators)

    def login(self, key: str) -> str | None:
        """The SHA-256 to keep in the session when `key` is a tenant's, else None."""
        digest = hashlib.sha256(key.strip().encode()).hexdigest()
        return digest if key.strip() and digest in self.tenant_key_hashes else None


GUARD = web.AppKey("guard", Guard)


def host_is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


COOKIES = web.AppKey("session_cookies", SessionCookies)


def csrf_token(session: dict[str, Any]) -> str:
    token = session.get(CSRF_FIELD)
    if not isinstance(token, str):
        token = random_tokens.token_urlsafe(32)
        session[CSRF_FIELD] = token
    return token


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Loads the session and saves it when it changed; between, the rules that `check` applies."""
    cookies = request.config_dict[COOKIES]
    loaded = cookies.load(request)
    request[SESSION] = dict(loaded)
    try:
        response = await check(request, handler)
    except web.HTTPException as e:
        if request[SESSION] != loaded:
            cookies.save(e, request[SESSION])
        raise
    if request[SESSION] != loaded:
        cookies.save(response, request[SESSION])
    return response


async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Host check, CSRF check on every POST, and a viewer for every page but the open ones."""
    rules = request.config_dict[GUARD]
    if not rules.needs_login and not host_is_loopback(request.host):
        raise web.HTTPMisdirectedRequest(
            text="this proxy's audit page answers on a loopback address only (no tenants are configured)"
        )
    session = request[SESSION]
    request[CSRF] = csrf_token(session)
    if request.method == "POST":
        form = await request.post()
        sent = form.get(CSRF_FIELD)
        if not isinstance(sent, str) or not hmac.compare_digest(sent, request[CSRF]):
            raise web.HTTPForbidden(
                text="the form's CSRF token is missing or stale; reload the page and try again"
            )
    viewer = rules.viewer_for(session.get("key"))
    if viewer is None:
        if request.path == "/ui" or request.path.startswith(OPEN_PATHS):
            return await handler(request)
        raise web.HTTPSeeOther(f"/ui/login?next={_local_path(request.path_qs)}")
    request[VIEWER] = viewer
    return await handler(request)


def _local_path(path: str) -> str:
    return quote(safe_next(path), safe="")


def safe_next(value: str | None) -> str:
    """Only a path on this page is a place to return to after login (no open redirect)."""
    if value and value.startswith("/ui/") and "//" not in value and "\\" not in value:
        return value
    return "/ui/"


def harden(request: web.Request, response: web.StreamResponse) -> None:
    """Headers on every answer of the page: no script or style from anywhere else, no framing, no caching."""
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Referrer-Policy"] = "no-referrer"
    if not request.path.startswith("/ui/static/"):
        response.headers["Cache-Control"] = "no-store"
