"""The `stackpin` command line: schema management, verification, audit and listing on a real audit store, keys,
`prove` and `witness` against a running proxy, and `serve` refusing a database whose schema is old."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.audit import AuditStore
from proxy.audit.note import COSIGNATURE, parse_signer
from proxy.audit.schema import upgrade_database
from proxy.commands.cli import main as stackpin
from tests.support.audit_databases import LOG_KEY_ENV, LOG_SIGNER, WITNESS_SIGNER, entry
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import running_proxy

VKEY = LOG_SIGNER.verifier.vkey


def write_config(folder: Path, db: Path) -> Path:
    config = folder / "stackpin.toml"
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{db}"\n[local_backend]\nenabled = "off"\n')
    return config


def fill(url: str, count: int) -> None:
    async def go() -> None:
        store = await AuditStore.open(url, signer=LOG_SIGNER)
        try:
            for i in range(count):
                tenant = "acme" if i % 2 == 0 else "globex"
                await store.append(entry(f"rec_{i:04d}", tenant=tenant, seconds=i))
        finally:
            await store.close()

    asyncio.run(go())


@pytest.fixture
def config(tmp_path: Path) -> Path:
    db = tmp_path / "audit.db"
    path = write_config(tmp_path, db)
    assert stackpin(["db", "upgrade", "--config", str(path)]) == 0
    fill(f"sqlite+aiosqlite:///{db}", 6)
    return path


def test_db_upgrade_creates_the_schema_and_is_idempotent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, tmp_path / "new.db")
    assert stackpin(["db", "upgrade", "--config", str(path)]) == 0
    assert stackpin(["db", "upgrade", "--config", str(path)]) == 0
    assert "newest schema" in capsys.readouterr().out


def test_verify_passes_on_an_intact_log_and_locates_an_edit(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert stackpin(["verify", "--config", str(config), "--log-key", VKEY]) == 0
    out = capsys.readouterr().out
    assert "log intact" in out and "signatures checked" in out and "checked 6 entries" in out
    kept = tmp_path / "kept.checkpoint"
    kept.write_text(_printed_checkpoint(out))
    import sqlite3

    with sqlite3.connect(tmp_path / "audit.db") as db:
        db.execute("UPDATE entries SET content = replace(content, 'hello', 'HELLO') WHERE seq = 3")
    assert stackpin(["verify", "--config", str(config), "--log-key", VKEY, "--checkpoint", str(kept)]) == 1
    assert "LOG BROKEN" in capsys.readouterr().out


def _printed_checkpoint(out: str) -> str:
    """The checkpoint verify prints to keep, as the note it is (its lines are indented by two spaces)."""
    block = out.split("keep it elsewhere, or have a witness keep it):\n", 1)[1]
    return "".join(line[2:] + "\n" for line in block.splitlines())


def test_verify_says_when_no_key_checked_the_signatures(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert stackpin(["verify", "--config", str(config)]) == 0
    assert "signatures NOT checked" in capsys.readouterr().out
    assert stackpin(["verify", "--config", str(config), "--log-key", "garbage"]) == 2
    assert "--log-key" in capsys.readouterr().err


def test_audit_prints_the_full_stack_and_each_entry_s_proof(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert stackpin(["audit", "rec_0002", "--config", str(config), "--log-key", VKEY]) == 0
    out = capsys.readouterr().out
    assert "cpu-x86_64-avx512" in out and "batch_invariant" in out
    assert "recomputes, proven in the checkpoint of size 6" in out and "signature checked" in out
    assert stackpin(["audit", "rec_0002", "--config", str(config), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["entries_ok"] is True and printed["entries"][0]["index"] == 2
    assert stackpin(["audit", "rec_missing", "--config", str(config)]) == 2


def test_keygen_writes_a_private_key_once_and_prints_its_verifier_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.key"
    assert stackpin(["keygen", "witness.example/w1", "--witness", "--out", str(path)]) == 0
    vkey = capsys.readouterr().out.strip()
    signer = parse_signer(path.read_text())
    assert (signer.kind, signer.verifier.vkey) == (COSIGNATURE, vkey)
    assert path.stat().st_mode & 0o777 == 0o600
    assert stackpin(["keygen", "witness.example/w1", "--out", str(path)]) == 2
    assert "never overwritten" in capsys.readouterr().err


async def test_prove_and_witness_check_a_running_proxy_s_log(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    witness_key, store = tmp_path / "w.key", tmp_path / "witness.jsonl"
    witness_key.write_text(WITNESS_SIGNER.text)
    async with running_proxy([replica], tmp_path, log={"signing_key_env": LOG_KEY_ENV}) as proxy:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        records = [(await proxy.post("/v1/chat/completions", body))[2]["Stackpin-Record"] for _ in range(3)]
        await proxy.proxy.store.integrate()
        client = ["--url", proxy.url, "--log-key", VKEY]
        watch = ["witness", *client, "--store", str(store), "--key", str(witness_key), "--once"]
        assert await asyncio.to_thread(stackpin, watch) == 0
        assert await asyncio.to_thread(stackpin, ["prove", records[1], *client]) == 0
        out = capsys.readouterr().out
        assert "cosigned checkpoint of size 3" in out and "PROVEN: leaf 1 of the tree of size 3" in out
        assert await asyncio.to_thread(stackpin, ["prove", records[1], *client, "--json"]) == 0
        saved = tmp_path / "proof.json"
        saved.write_text(capsys.readouterr().out)
        checkpoint = tmp_path / "checkpoint"
        checkpoint.write_text((await proxy.proxy.store.checkpoint()).note)
        await proxy.post("/v1/chat/completions", body)
        await proxy.proxy.store.integrate()
        assert await asyncio.to_thread(stackpin, watch) == 0
        config = tmp_path / "verify.toml"
        config.write_text(f'[store]\nurl = "{proxy.settings.store.url}"\n[local_backend]\nenabled = "off"\n')
    offline = ["prove", records[1], "--proof", str(saved), "--checkpoint", str(checkpoint), "--log-key", VKEY]
    assert await asyncio.to_thread(stackpin, offline) == 0, "checked from the saved files alone"
    assert await asyncio.to_thread(stackpin, [*offline[:2], "--proof", str(saved), "--log-key", VKEY]) == 0
    assert await asyncio.to_thread(stackpin, ["prove", records[0], *offline[2:]]) == 2, (
        "another record's proof"
    )
    witnessed = ["verify", "--config", str(config), "--log-key", VKEY, "--witness", str(store)]
    assert await asyncio.to_thread(stackpin, [*witnessed, "--witness-key", WITNESS_SIGNER.verifier.vkey]) == 0
    out = capsys.readouterr().out
    assert "2 checkpoints held outside the database matched" in out and "log intact" in out


def test_records_lists_and_filters(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert stackpin(["records", "--config", str(config), "--tenant", "acme", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(r["id"] for r in listed) == ["rec_0000", "rec_0002", "rec_0004"]
    assert stackpin(["records", "--config", str(config), "--model", "nope"]) == 0
    assert "no records match" in capsys.readouterr().out
    assert (
        stackpin(["records", "--config", str(config), "--since", "2026-01-02T03:04:08+00:00", "--json"]) == 0
    )
    assert len(json.loads(capsys.readouterr().out)) == 3
    fingerprint = listed[0]["fingerprint"]
    assert stackpin(["records", "--config", str(config), "--stack", fingerprint[:12], "--json"]) == 0
    assert {r["fingerprint"] for r in json.loads(capsys.readouterr().out)} == {fingerprint}, (
        "the 12-character prefix the listing prints selects its stack"
    )
    assert stackpin(["records", "--config", str(config), "--stack", "NOT-HEX"]) == 2
    assert "lowercase hex" in capsys.readouterr().out


def test_serve_refuses_an_old_schema_and_names_the_command(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    upgrade_database(f"sqlite+aiosqlite:///{db}", "0001_chain")
    path = write_config(tmp_path, db)
    result = subprocess.run(
        [sys.executable, "-m", "proxy.commands.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STACKPIN_SERVER__PORT": "0"},
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "stackpin db upgrade" in result.stderr


def test_reading_commands_refuse_a_store_that_does_not_exist_and_create_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "typo.db"
    path = write_config(tmp_path, missing)
    for command in (["verify"], ["records"], ["audit", "rec_0000"]):
        assert stackpin([*command, "--config", str(path)]) == 2
        said = "".join(capsys.readouterr())
        assert "does not exist" in said and "typo.db" in said, said
    assert not missing.exists(), "reading a store must never create one"


def test_a_bad_configuration_is_one_clear_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[server]\nhost = "0.0.0.0"\n[local_backend]\nenabled = "off"\n')
    assert stackpin(["serve", "--config", str(path)]) == 2
    assert "tenants" in capsys.readouterr().err
    path.write_text("[store\n")
    assert stackpin(["records", "--config", str(path)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


async def test_audit_shows_every_choice_and_its_tool_calls(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2}
    async with running_proxy([replica], tmp_path) as harness:
        _, _, plain = await harness.post("/v1/chat/completions", body)
        _, _, called = await harness.post("/v1/chat/completions", {**body, "n": 1, "tools": tools})
    config = write_config(tmp_path, tmp_path / "audit.db")
    assert (
        await asyncio.to_thread(stackpin, ["audit", plain["Stackpin-Record"], "--config", str(config)]) == 0
    )
    out = capsys.readouterr().out
    assert "choice   0  finish_reason=length" in out and "choice   1  finish_reason=length" in out
    assert "(choice 1)" in out, "the later choice's text is shown"
    assert (
        await asyncio.to_thread(stackpin, ["audit", called["Stackpin-Record"], "--config", str(config)]) == 0
    )
    out = capsys.readouterr().out
    assert "tool     call_0 weather({" in out and '"units": "metric"' in out


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    return lines[0]


def test_commands_that_only_read_the_store_need_no_secret(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    production = tmp_path / "production.toml"
    production.write_text(
        config.read_text()
        + '[server]\nhost = "0.0.0.0"\n'
        + '[[replicas]]\nname = "openai"\nurl = "https://api.openai.com"\napi_key_env = "STACKPIN_TEST_UNSET_UP"\n'
        + 'stack = { model = "gpt-4o-mini" }\n'
        + '[[tenants]]\nname = "acme"\napi_key_env = "STACKPIN_TEST_UNSET_ACME"\n'
    )
    assert "STACKPIN_TEST_UNSET_UP" not in os.environ and "STACKPIN_TEST_UNSET_ACME" not in os.environ
    assert stackpin(["verify", "--config", str(production)]) == 0
    assert stackpin(["audit", "rec_0002", "--config", str(production)]) == 0
    capsys.readouterr()
    assert stackpin(["records", "--config", str(production), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 6
    assert stackpin(["serve", "--config", str(production)]) == 2, "serving needs the keys"
    assert "STACKPIN_TEST_UNSET_UP" in one_line(capsys.readouterr().err)


def test_usage_errors_are_one_line_and_exit_2(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert stackpin(["replay", "rec_0001", "--config", str(config), "--on", "foo=bar"]) == 2
    assert "foo" in one_line(capsys.readouterr().err)
    assert stackpin(["records", "--config", str(config), "--since", "2026-12-01T07:22:00"]) == 2
    assert "time zone" in one_line(capsys.readouterr().err)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert stackpin(["serve", "--config", str(config), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in one_line(capsys.readouterr().err)
    assert stackpin(["serve", "--config", str(config), "--host", "0.0.0.0"]) == 2
    assert "tenants" in one_line(capsys.readouterr().err), "--host is checked like [server] host"


def test_records_say_where_they_stopped_and_how_to_page_on(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert stackpin(["records", "--config", str(config), "--limit", "4", "--json"]) == 0
    captured = capsys.readouterr()
    first = [r["id"] for r in json.loads(captured.out)]
    assert "stopped at the limit of 4 records" in one_line(captured.err)
    last = one_line(captured.err).split("--before ", 1)[1].split()[0]
    assert last == first[-1]
    assert stackpin(["records", "--config", str(config), "--limit", "4", "--before", last, "--json"]) == 0
    captured = capsys.readouterr()
    rest = [r["id"] for r in json.loads(captured.out)]
    assert sorted(first + rest) == [f"rec_{i:04d}" for i in range(6)]
    assert captured.err == "", "a listing that reaches the end says nothing more"
    assert stackpin(["records", "--config", str(config), "--limit", "6"]) == 0
    assert capsys.readouterr().err == "", "six records, all shown"


def test_help_shows_the_description_whole(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        stackpin(["--help"])
    assert exit_info.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "registers a backend in a fleet (`stackpin fleet heartbeat`)." in shown
    assert "replay` exits 0 when reproduced, 1 when diverged, 2 on error" in shown
