"""Where the log's keys come from: never the database; the embedded default makes its own beside its SQLite file,
a PostgreSQL fleet must be given one, and what verification trusts is configured apart from what signs."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from proxy.audit.keys import serving_signer, trusted_log_keys, write_key
from proxy.audit.note import COSIGNATURE, generate_signer
from proxy.config import Settings, resolve_secrets
from proxy.errors import ConfigError
from proxy.logs import configure_logging
from tests.support.audit_databases import LOG_SIGNER, POSTGRES_URL


def settings(url: str, **log: object) -> Settings:
    return Settings(store={"url": url}, local_backend={"enabled": "off"}, log=log)


def test_the_embedded_default_makes_its_key_beside_its_database_once(tmp_path: Path) -> None:
    config = settings(f"sqlite+aiosqlite:///{tmp_path / 'audit.db'}")
    made = serving_signer(config, resolve_secrets(config, {}))
    path = tmp_path / "audit.db.log.key"
    assert path.stat().st_mode & 0o777 == 0o600
    again = serving_signer(config, resolve_secrets(config, {}))
    assert again == made and made.name.startswith("stackpin.local/")
    assert trusted_log_keys(config, resolve_secrets(config, {}), []) == [made.verifier]


def test_a_key_made_at_start_logs_its_verifier_key_and_never_its_signing_key(tmp_path: Path) -> None:
    config = settings(f"sqlite+aiosqlite:///{tmp_path / 'audit.db'}")
    sink = io.StringIO()
    configure_logging("info", sink)
    try:
        made = serving_signer(config, resolve_secrets(config, {}))
    finally:
        configure_logging("info", sys.stderr)
    (line,) = [json.loads(text) for text in sink.getvalue().splitlines() if "log_key_created" in text]
    assert made.verifier.vkey in line.values(), f"the verifier key, public, is what a verifier trusts: {line}"
    assert made.text not in sink.getvalue() and made.text.split("+")[-1] not in sink.getvalue()


def test_a_shared_database_needs_a_key_it_is_given(tmp_path: Path) -> None:
    config = settings(POSTGRES_URL)
    with pytest.raises(ConfigError, match="signing_key_env or signing_key_file"):
        serving_signer(config, resolve_secrets(config, {}))
    named = settings(POSTGRES_URL, signing_key_env="LOG_KEY")
    with pytest.raises(ConfigError, match="LOG_KEY, which is not set"):
        serving_signer(named, resolve_secrets(named, {}))
    assert serving_signer(named, resolve_secrets(named, {"LOG_KEY": LOG_SIGNER.text})) == LOG_SIGNER
    missing = settings(POSTGRES_URL, signing_key_file=str(tmp_path / "nope.key"))
    with pytest.raises(ConfigError, match="does not exist"):
        serving_signer(missing, resolve_secrets(missing, {}))


def test_a_witness_key_cannot_sign_the_log(tmp_path: Path) -> None:
    path = tmp_path / "w.key"
    write_key(path, generate_signer("witness.test/w", COSIGNATURE))
    config = settings(POSTGRES_URL, signing_key_file=str(path))
    with pytest.raises(ConfigError, match="cosigner key, not a log key"):
        serving_signer(config, resolve_secrets(config, {}))


def test_verification_trusts_the_keys_it_is_told_to_first() -> None:
    rotated = generate_signer(LOG_SIGNER.name)
    config = settings(POSTGRES_URL, signing_key_env="LOG_KEY", public_keys=[LOG_SIGNER.verifier.vkey])
    secrets = resolve_secrets(config, {"LOG_KEY": rotated.text})
    assert trusted_log_keys(config, secrets, []) == [LOG_SIGNER.verifier]
    assert trusted_log_keys(config, secrets, [rotated.verifier.vkey]) == [rotated.verifier]
    with pytest.raises(ValueError, match="NAME\\+KEYID\\+BASE64"):
        settings(POSTGRES_URL, public_keys=["not a key"])
