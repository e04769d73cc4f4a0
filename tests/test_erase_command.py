"""`stackpin erase` (proxy/commands/erase.py) against a running proxy's store: the record's request and answer go,
and `verify`, `audit`, `prove`, a replay and the audit page say "erased" instead of failing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from proxy.audit.note import parse_signer
from proxy.commands.cli import main as stackpin
from proxy.config import log_key_file
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, running_proxy

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "my address is 1 Main St"}],
    "max_tokens": 4,
}


def _config(harness: Harness, folder: Path) -> list[str]:
    path = folder / "stackpin.toml"
    path.write_text(f'[store]\nurl = "{harness.settings.store.url}"\n')
    key_file = log_key_file(harness.settings)
    assert key_file is not None
    return ["--config", str(path), "--log-key", parse_signer(key_file.read_text()).verifier.vkey]


async def test_an_erased_record_says_erased_everywhere_and_its_proof_stays_valid(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        _, _, headers = await harness.post("/v1/chat/completions", CHAT)
        _, _, kept = await harness.post("/v1/chat/completions", CHAT)
        record_id = headers["Stackpin-Record"]
        _, replayed, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
        config = _config(harness, tmp_path)
        erase = ["erase", record_id, "--config", config[1], "--reason", "the customer asked"]
        assert await asyncio.to_thread(stackpin, erase) == 0
        assert f"{record_id}: erased" in capsys.readouterr().out
        assert await asyncio.to_thread(stackpin, erase) == 1
        assert "erased already" in capsys.readouterr().out
        await harness.proxy.store.integrate()

        status, body = await harness.get(f"/v1/records/{record_id}")
        assert status == 200 and body["entries"][0]["payload"] == "erased"
        assert "1 Main St" not in str(body) and body["erasures"][0]["content"]["why"] == "the customer asked"
        status, body, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
        assert status == 410 and body["error"]["code"] == "payload_erased"
        assert "erased at" in body["error"]["message"] and "by request policy" in body["error"]["message"]
        status, _, _ = await harness.post(f"/v1/records/{kept['Stackpin-Record']}/replay", {})
        assert status == 200, "the other record replays as before"

        prove = ["prove", record_id, "--url", harness.url, config[2], config[3]]
        assert await asyncio.to_thread(stackpin, prove) == 0
        assert "its payload (request and answer) was erased" in capsys.readouterr().out
        assert await asyncio.to_thread(stackpin, ["audit", record_id, *config]) == 0
        printed = capsys.readouterr().out
        assert "request and answer were erased at" in printed and "payload erased" in printed
        assert await asyncio.to_thread(stackpin, ["verify", *config]) == 0
        assert "3 kept, each hashing to what its entry commits to; 1 erased" in capsys.readouterr().out, (
            "the other record and both replays"
        )
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{harness.url}/ui/records/{record_id}") as page,
        ):
            html = await page.text()
        assert page.status == 200 and 'id="erased"' in html and "1 Main St" not in html
        diff = f"{harness.url}/ui/records/{replayed['replay_record']}/diff"
        async with aiohttp.ClientSession() as session, session.get(diff) as page:
            assert page.status == 410 and "nothing is left to compare" in await page.text()


async def test_erase_refuses_what_it_cannot_do_and_says_how(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "stackpin.toml"
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path / "none.db"}"\n')
    assert stackpin(["erase", "--config", str(config), "rec_1"]) == 2
    assert "--reason is required" in capsys.readouterr().err
    assert stackpin(["erase", "--config", str(config)]) == 2
    assert stackpin(["erase", "--config", str(config), "rec_1", "--expired"]) == 2
    assert await asyncio.to_thread(stackpin, ["erase", "--config", str(config), "--expired"]) == 0
    assert "no retention policy" in capsys.readouterr().out
