"""The audit page's protections, over real HTTP: login with a tenant's key, session cookies, CSRF on every POST,
tenant scoping as on the API, loopback-only without tenants, escaping, security headers, and no secret rendered."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from yarl import URL

from proxy.audit import RecordFilter
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, running_proxy

KEYS = {"KEY_ACME": "sk-acme-0a1b", "KEY_GLOBEX": "sk-globex-2c3d", "KEY_OPS": "sk-ops-4e5f"}
UPSTREAM_KEY = "sk-upstream-6a7b8c"
SESSION_KEY = "session-key-9d0e"
TENANTS = [{"name": name, "api_key_env": f"KEY_{name.upper()}"} for name in ("acme", "globex", "ops")]
CHAT = {"model": "fake-model", "max_tokens": 6, "temperature": 0}


@pytest.fixture
async def harness(replica: FakeReplica, tmp_path: Path) -> AsyncIterator[Harness]:
    async with running_proxy(
        [replica],
        tmp_path,
        environ={**KEYS, "UPSTREAM_KEY": UPSTREAM_KEY, "UI_SESSION_KEY": SESSION_KEY},
        tenants=TENANTS,
        replicas=[{"name": "replica-0", "url": replica.url, "api_key_env": "UPSTREAM_KEY"}],
        ui={"operators": ["ops"], "session_key_env": "UI_SESSION_KEY"},
    ) as running:
        yield running


async def ask(harness: Harness, tenant: str, content: str) -> str:
    key = KEYS[f"KEY_{tenant.upper()}"]
    body = {**CHAT, "messages": [{"role": "user", "content": content}]}
    status, _, headers = await harness.post(
        "/v1/chat/completions", body, headers={"Authorization": f"Bearer {key}"}
    )
    assert status == 200
    return headers["Stackpin-Record"]


def browser() -> aiohttp.ClientSession:
    # unsafe: the cookie jar keeps cookies for an IP address host, as a browser does.
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


def token(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None, "every form carries the CSRF token"
    return found.group(1)


async def log_in(session: aiohttp.ClientSession, harness: Harness, tenant: str) -> str:
    async with session.get(f"{harness.url}/ui/login") as page:
        csrf = token(await page.text())
    form = {"key": KEYS[f"KEY_{tenant.upper()}"], "csrf": csrf, "next": "/ui/"}
    async with session.post(f"{harness.url}/ui/login", data=form) as landed:
        assert landed.status == 200 and landed.url.path == "/ui/"
        return token(await landed.text())


async def test_without_a_session_every_page_sends_to_the_login_and_a_wrong_key_is_refused(
    harness: Harness,
) -> None:
    async with browser() as session:
        async with session.get(f"{harness.url}/ui/stacks", allow_redirects=False) as response:
            assert response.status == 303
            location = URL(response.headers["Location"])
            assert location.path == "/ui/login" and location.query["next"] == "/ui/stacks"
        async with session.get(f"{harness.url}/ui/login") as page:
            csrf = token(await page.text())
        async with session.post(f"{harness.url}/ui/login", data={"key": "sk-wrong", "csrf": csrf}) as refused:
            assert refused.status == 401 and "That key is not known here." in await refused.text()
        async with session.get(f"{harness.url}/ui", allow_redirects=False) as bare:
            assert bare.status == 302 and bare.headers["Location"] == "/ui/"


async def test_the_session_cookie_is_httponly_samesite_strict_scoped_and_holds_no_key(
    harness: Harness,
) -> None:
    async with browser() as session:
        async with session.get(f"{harness.url}/ui/login") as page:
            csrf = token(await page.text())
        form = {"key": KEYS["KEY_ACME"], "csrf": csrf}
        async with session.post(f"{harness.url}/ui/login", data=form, allow_redirects=False) as landed:
            assert landed.status == 303
            cookie = landed.cookies["stackpin_ui"]
    assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/ui"
    assert not cookie["secure"], "on loopback the page is plain HTTP; beyond it the cookie is Secure"
    assert int(cookie["max-age"]) == 8 * 3600
    assert all(key not in cookie.value for key in (*KEYS.values(), SESSION_KEY))


async def test_a_login_ends_elsewhere_only_on_this_page(harness: Harness) -> None:
    async with browser() as session:
        async with session.get(f"{harness.url}/ui/login") as page:
            csrf = token(await page.text())
        form = {"key": KEYS["KEY_ACME"], "csrf": csrf, "next": "//evil.example/phish"}
        async with session.post(f"{harness.url}/ui/login", data=form, allow_redirects=False) as landed:
            assert landed.headers["Location"] == "/ui/", "no open redirect after a login"


async def test_every_post_needs_the_sessions_csrf_token(harness: Harness) -> None:
    record_id = await ask(harness, "acme", "hello")
    async with browser() as session:
        csrf = await log_in(session, harness, "acme")
        replay = f"{harness.url}/ui/records/{record_id}/replay"
        for form in ({}, {"csrf": "forged"}, {"csrf": csrf + "x"}):
            async with session.post(replay, data=form, allow_redirects=False) as refused:
                assert refused.status == 403 and "CSRF" in await refused.text()
        async with session.post(f"{harness.url}/ui/logout", data={}, allow_redirects=False) as refused:
            assert refused.status == 403
        async with session.post(f"{harness.url}/ui/probe", data={"model": "fake-model"}) as refused:
            assert refused.status == 403
        assert (await harness.proxy.store.count_records(_replays_of(record_id))).total == 0, (
            "nothing replayed"
        )
        async with session.post(replay, data={"csrf": csrf}, allow_redirects=False) as accepted:
            assert accepted.status == 303 and accepted.headers["Location"].endswith("/diff")


def _replays_of(record_id: str) -> RecordFilter:
    return RecordFilter(replay_of=record_id)


async def test_a_tenant_reads_and_replays_only_its_own_records_and_an_operator_reads_all(
    harness: Harness,
) -> None:
    mine, theirs = await ask(harness, "acme", "mine"), await ask(harness, "globex", "theirs")
    async with browser() as session:
        csrf = await log_in(session, harness, "acme")
        async with session.get(f"{harness.url}/ui/") as listing:
            html = await listing.text()
        assert mine in html and theirs not in html
        async with session.get(f"{harness.url}/ui/?tenant=globex") as listing:
            assert theirs not in await listing.text(), "a tenant cannot widen its scope by a filter"
        for path in (f"/ui/records/{theirs}", f"/ui/records/{theirs}/diff"):
            async with session.get(harness.url + path) as response:
                assert response.status == 404
        async with session.post(f"{harness.url}/ui/records/{theirs}/replay", data={"csrf": csrf}) as response:
            assert response.status == 404
    async with browser() as session:
        await log_in(session, harness, "ops")
        async with session.get(f"{harness.url}/ui/?tenant=globex") as listing:
            html = await listing.text()
        assert theirs in html and mine not in html
        async with session.get(f"{harness.url}/ui/records/{theirs}") as response:
            assert response.status == 200


async def test_pages_carry_a_strict_content_security_policy_and_are_not_cached(harness: Harness) -> None:
    async with browser() as session:
        await log_in(session, harness, "acme")
        async with session.get(f"{harness.url}/ui/stacks") as page:
            assert "script-src 'self'" in page.headers["Content-Security-Policy"]
            assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
            assert page.headers["Cache-Control"] == "no-store" and page.headers["X-Frame-Options"] == "DENY"
            stylesheet = re.search(r'href="(/ui/static/ui\.css\?v=[0-9a-f]+)"', await page.text())
        assert stylesheet is not None
        async with session.get(harness.url + stylesheet.group(1)) as asset:
            assert asset.status == 200 and "text/css" in asset.headers["Content-Type"]


async def test_markup_in_prompts_and_answers_is_escaped_and_no_secret_is_rendered(
    replica: FakeReplica, harness: Harness
) -> None:
    replica.words = ["<script>alert(1)</script>", '" onmouseover="x', "<b>b</b>"]
    record_id = await ask(harness, "acme", "<img src=x onerror=alert(2)>")
    async with browser() as session:
        csrf = await log_in(session, harness, "acme")
        pages = [f"/ui/records/{record_id}", "/ui/", "/ui/stacks", "/ui/probe"]
        async with session.post(f"{harness.url}/ui/records/{record_id}/replay", data={"csrf": csrf}) as diff:
            assert diff.status == 200
            pages.append(diff.url.path)
        form = {
            "csrf": csrf,
            "model": "fake-model",
            "prompt": "<img src=x onerror=alert(3)>",
            "requests": "2",
        }
        form.update(concurrency="1", max_tokens="4", temperature="0", pin="")
        async with session.post(f"{harness.url}/ui/probe", data=form) as probed:
            bodies = [await probed.text()]
        for path in pages:
            async with session.get(harness.url + path) as page:
                bodies.append(await page.text())
    for html in bodies:
        assert "<script>alert" not in html and "<img src=x" not in html and '" onmouseover="x' not in html
        assert all(secret not in html for secret in (*KEYS.values(), UPSTREAM_KEY, SESSION_KEY))
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in bodies[1] + bodies[2]


async def test_without_tenants_the_page_needs_no_login_and_answers_only_a_loopback_host(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness, browser() as session:
        record_id = await ask_local(harness)
        async with session.get(f"{harness.url}/ui/") as page:
            assert page.status == 200 and record_id in await page.text()
        for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
            async with session.get(f"{harness.url}/ui/", headers={"Host": host}) as page:
                assert page.status == 421, f"Host {host}: a rebinding page must not read the records"
        async with session.get(URL(f"{harness.url}/ui/"), headers={"Host": "localhost"}) as page:
            assert page.status == 200


async def ask_local(harness: Harness) -> str:
    status, _, headers = await harness.post(
        "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 200
    return headers["Stackpin-Record"]


async def test_a_quarantine_shows_as_flags_on_its_records_and_as_the_replicas_state(
    replica: FakeReplica, harness: Harness
) -> None:
    served, other = await ask(harness, "acme", "before the change"), await ask(harness, "globex", "theirs")
    registered = harness.proxy.registry.get("replica-0")
    assert registered is not None
    await harness.proxy.health.quarantine(registered, "stack_changed", claimed="f" * 64)
    async with browser() as session:
        await log_in(session, harness, "acme")
        async with session.get(f"{harness.url}/ui/?flagged=on") as listing:
            html = await listing.text()
        assert served in html and other not in html and "1 flagged" in html
        async with session.get(f"{harness.url}/ui/records/{served}") as page:
            html = await page.text()
        assert 'id="flags"' in html and "stack_changed" in html and "f" * 64 in html
        async with session.get(f"{harness.url}/ui/stacks") as page:
            html = await page.text()
        assert "quarantined" in html and "the stack it proves changed after it was registered" in html
        async with session.get(f"{harness.url}/ui/no-such-page") as missing:
            assert missing.status == 404 and "Content-Security-Policy" in missing.headers
            assert "<h1>404</h1>" in await missing.text()
