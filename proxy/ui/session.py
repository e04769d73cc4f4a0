"""The audit page's session: a small JSON object in an encrypted, authenticated cookie (Fernet, from the
`cryptography` package), so that no proxy of a fleet keeps session state.

The cookie is `HttpOnly`, `SameSite=Strict`, scoped to /ui, and `Secure` when the proxy listens beyond loopback.
Fernet stamps each cookie with the time it was written, and a cookie older than the session's lifetime is read as
no session: since the cookie is written again only when the session changes (a login, a new CSRF token), a login
lasts at most that long. The key comes from `ui.session_key_env` (shared by a fleet's proxies) or is drawn at
start, which ends every session when the proxy restarts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from typing import Any

from aiohttp import web
from cryptography.fernet import Fernet, InvalidToken

from proxy.config import Secrets, Settings

COOKIE = "stackpin_ui"
PATH = "/ui"
SESSION = web.RequestKey("session", dict)


class SessionCookies:
    def __init__(self, key: bytes, *, max_age_s: int, secure: bool) -> None:
        self._fernet = Fernet(base64.urlsafe_b64encode(hashlib.sha256(key).digest()))
        self.max_age_s = max_age_s
        self.secure = secure

    @classmethod
    def of(cls, settings: Settings, secrets_: Secrets) -> SessionCookies:
        configured = secrets_.ui_session_key
        key = configured.get_secret_value().encode() if configured else secrets.token_bytes(32)
        secure = settings.ui.secure_cookie
        return cls(
            key,
            max_age_s=settings.ui.session_max_age_s,
            secure=(not settings.server.loopback_only) if secure is None else secure,
        )

    def load(self, request: web.Request) -> dict[str, Any]:
        token = request.cookies.get(COOKIE)
        if not token:
            return {}
        try:
            data = json.loads(self._fernet.decrypt(token.encode(), ttl=self.max_age_s))
        except (InvalidToken, ValueError):
            return {}  # forged, from another key, or expired: no session
        return data if isinstance(data, dict) else {}

    def save(self, response: web.StreamResponse, data: dict[str, Any]) -> None:
        if not data:
            response.del_cookie(COOKIE, path=PATH)
            return
        response.set_cookie(
            COOKIE,
            self._fernet.encrypt(json.dumps(data, sort_keys=True).encode()).decode(),
            max_age=self.max_age_s,
            path=PATH,
            httponly=True,
            samesite="Strict",
            secure=self.secure,
        )
