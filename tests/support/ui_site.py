"""The audit page's browser tests' world: a real proxy with tenants over fake replicas, and a real Chromium.

The proxy runs on its own event loop in a thread, so that the tests can drive the browser with Playwright's
synchronous API while the proxy answers; `Site.call` runs a coroutine on the proxy's loop. Chromium is Debian's
(`/usr/bin/chromium`, installed by `.ci/run`): Playwright's own browser download cannot work here. Screenshots go
to `test-artifacts/ui/`, which git ignores.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Coroutine, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support.fake_replica import WORDS, FakeReplica, tiny_stack
from tests.support.proxy_harness import Harness, running_proxy

T = TypeVar("T")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "ui"
KEYS = {
    "STACKPIN_KEY_ACME": "sk-acme-3f9a1c",
    "STACKPIN_KEY_GLOBEX": "sk-globex-77b2e0",
    "STACKPIN_KEY_OPS": "sk-ops-c1d2",
}
UPSTREAM_KEY = "sk-upstream-never-shown-5e1f"
TENANTS = [
    {"name": "acme", "api_key_env": "STACKPIN_KEY_ACME"},
    {"name": "globex", "api_key_env": "STACKPIN_KEY_GLOBEX"},
    {"name": "ops", "api_key_env": "STACKPIN_KEY_OPS"},
]
# Completions made of these carry markup and attribute breakers; the page must print them as text.
XSS_WORDS = [
    "<script>alert('answer')</script>",
    '" onmouseover="alert(1)',
    "<img src=x onerror=alert(2)>",
    *WORDS,
]
XSS_PROMPT = "<script>alert('prompt')</script> \"><b onmouseover=alert(3)>bold</b>"


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "Debian's chromium is not installed (apt-get install chromium; .ci/run does it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


@dataclass
class Site:
    """The running proxy: its URL, its fakes, and its loop."""

    url: str
    harness: Harness
    replica: FakeReplica  # batch_invariant, its words are XSS_WORDS
    other: FakeReplica  # a second live stack (kernel_mode default)
    loop: asyncio.AbstractEventLoop
    records: dict[str, list[str]] = field(default_factory=dict)  # tenant -> record ids, oldest first

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    def ask(self, tenant: str, content: str, *, max_tokens: int = 8, **body: Any) -> str:
        """One chat completion as `tenant`, on `replica` unless `stackpin` pins another; returns its record id."""
        body.setdefault("stackpin", {"kernel_mode": "batch_invariant"})
        key = KEYS[f"STACKPIN_KEY_{tenant.upper()}"]
        request = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        }
        status, answer, headers = self.call(
            self.harness.post("/v1/chat/completions", request, headers={"Authorization": f"Bearer {key}"})
        )
        assert status == 200, answer
        self.records.setdefault(tenant, []).append(headers["Stackpin-Record"])
        return headers["Stackpin-Record"]


@dataclass
class _Running:
    site: Site | None = None
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    stop: asyncio.Event | None = None


def run_site(folder: Path) -> Iterator[Site]:
    """Starts the proxy in a thread, yields the site, and stops it."""
    running = _Running()
    thread = threading.Thread(target=asyncio.run, args=(_serve(folder, running),), daemon=True)
    thread.start()
    running.ready.wait(timeout=120)
    if running.error is not None or running.site is None:
        raise RuntimeError("the proxy for the browser tests did not start") from running.error
    site = running.site
    try:
        yield site
    finally:
        assert running.stop is not None
        site.loop.call_soon_threadsafe(running.stop.set)
        thread.join(timeout=60)


async def _serve(folder: Path, running: _Running) -> None:
    try:
        async with AsyncExitStack() as stack:
            replica = FakeReplica(words=XSS_WORDS)
            other = FakeReplica(stack=tiny_stack(kernel_mode="default"))
            for fake in (replica, other):
                await fake.start()
                stack.push_async_callback(fake.stop)
            harness = await stack.enter_async_context(
                running_proxy(
                    [replica, other],
                    folder,
                    environ={**KEYS, "UPSTREAM_KEY": UPSTREAM_KEY},
                    tenants=TENANTS,
                    ui={"operators": ["ops"]},
                    replicas=[
                        {"name": "invariant-0", "url": replica.url, "api_key_env": "UPSTREAM_KEY"},
                        {"name": "default-0", "url": other.url},
                    ],
                )
            )
            running.stop = asyncio.Event()
            running.site = Site(harness.url, harness, replica, other, asyncio.get_running_loop())
            running.ready.set()
            await running.stop.wait()
    except BaseException as e:
        running.error = e
        running.ready.set()
