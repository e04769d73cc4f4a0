"""Per-tenant rate limits: requests and tokens per minute, enforced across every proxy of a fleet, refused with an
OpenAI-style 429 and Retry-After, and still enforced (per proxy) while Redis is unreachable."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from proxy.config import load_settings
from proxy.errors import ConfigError, RateLimited
from proxy.fleet.limits import Limits, RateLimiter, refusal, window_of
from tests.support.audit_databases import audit_database
from tests.support.fake_replica import FakeReplica
from tests.support.fleet import T0, Clock, RedisRelay, running_fleet

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 3,
    "temperature": 0,
}
KEYS = {"ACME_KEY": "acme-secret", "GLOBEX_KEY": "globex-secret"}
ACME = {"Authorization": "Bearer acme-secret"}
GLOBEX = {"Authorization": "Bearer globex-secret"}


def tenants(**acme_limits: int) -> list[dict[str, Any]]:
    return [
        {"name": "acme", "api_key_env": "ACME_KEY", **acme_limits},
        {"name": "globex", "api_key_env": "GLOBEX_KEY"},
    ]


def test_a_minute_is_the_epoch_minute_and_retry_after_counts_to_its_end() -> None:
    window, retry_after = window_of(T0)
    assert window == int(T0.timestamp()) // 60 and retry_after == 30
    assert window_of(datetime(2026, 3, 4, 5, 6, 59, 999000, tzinfo=UTC))[1] == 1, "never 0"
    assert refusal(2, 0, Limits(requests_per_minute=2)) == "requests"
    assert refusal(1, 10, Limits(requests_per_minute=2, tokens_per_minute=10)) == "tokens"
    assert refusal(1, 9, Limits(requests_per_minute=2, tokens_per_minute=10)) is None


async def test_local_counting_refuses_past_the_limit_and_forgets_old_minutes() -> None:
    clock = Clock()
    limiter = RateLimiter({"acme": Limits(requests_per_minute=1)}, None, clock=clock)
    await limiter.admit("acme")
    await limiter.admit("nobody-limited")
    with pytest.raises(RateLimited, match="requests per minute: limit 1, used 1; try again in 30 s"):
        await limiter.admit("acme")
    clock.advance(30)
    await limiter.admit("acme")


def test_limits_and_the_redis_url_are_checked_when_the_configuration_loads(tmp_path: Path) -> None:
    config = tmp_path / "stackpin.toml"
    config.write_text(
        '[fleet]\nredis_url = "http://127.0.0.1:6379"\n\n'
        '[[tenants]]\nname = "acme"\napi_key_sha256 = ["00"]\nrequests_per_minute = 0\n'
    )
    with pytest.raises(ConfigError) as refused:
        load_settings(config, {})
    assert "redis_url must start with redis://" in str(refused.value)
    assert "tenants.0.requests_per_minute" in str(refused.value)


@pytest.mark.redis
async def test_requests_per_minute_hold_across_proxies(replica: FakeReplica, tmp_path: Path) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(
            db, {"r1": replica}, tenants=tenants(requests_per_minute=3), environ=KEYS
        ) as fleet:
            first, second = fleet.proxies
            for proxy in (first, second, first):
                assert (await proxy.post("/v1/chat/completions", CHAT, headers=ACME))[0] == 200
            status, body, headers = await second.post("/v1/chat/completions", CHAT, headers=ACME)
            assert status == 429
            assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
            assert "limit 3, used 3" in body["error"]["message"]
            assert headers["Retry-After"] == "30"
            assert len(replica.requests) == 3, "a refused request reaches no replica"
            assert (await second.post("/v1/chat/completions", CHAT, headers=GLOBEX))[0] == 200
            fleet.clock.advance(30)  # the next minute
            assert (await second.post("/v1/chat/completions", CHAT, headers=ACME))[0] == 200


@pytest.mark.redis
async def test_tokens_per_minute_count_what_the_answers_used(replica: FakeReplica, tmp_path: Path) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(
            db, {"r1": replica}, tenants=tenants(tokens_per_minute=10), environ=KEYS
        ) as fleet:
            first, second = fleet.proxies
            # The fake replica reports 3 prompt tokens plus max_tokens completion tokens.
            assert (await first.post("/v1/chat/completions", {**CHAT, "max_tokens": 4}, headers=ACME))[
                0
            ] == 200
            await limiter_of(first).drain()
            assert (await second.post("/v1/chat/completions", {**CHAT, "max_tokens": 1}, headers=ACME))[
                0
            ] == 200
            await limiter_of(second).drain()
            status, body, _ = await first.post("/v1/chat/completions", CHAT, headers=ACME)
            assert status == 429 and body["error"]["type"] == "tokens"
            assert "limit 10, used 11" in body["error"]["message"]


@pytest.mark.redis
async def test_without_redis_each_proxy_still_enforces_the_limit(
    replica: FakeReplica, tmp_path: Path
) -> None:
    relay = RedisRelay()
    await relay.start()
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(
            db,
            {"r1": replica},
            proxies=1,
            redis_url=relay.url,
            tenants=tenants(requests_per_minute=1),
            environ=KEYS,
        ) as fleet:
            (proxy,) = fleet.proxies
            await relay.cut()
            assert not await fleet.sync(0).round()
            assert (await proxy.post("/v1/chat/completions", CHAT, headers=ACME))[0] == 200
            assert (await proxy.post("/v1/chat/completions", CHAT, headers=ACME))[0] == 429


def limiter_of(harness: Any) -> RateLimiter:
    return harness.fleet.limiter
