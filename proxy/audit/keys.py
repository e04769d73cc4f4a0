"""The log's keys as the proxy and its commands use them: the signing key a proxy needs to integrate and sign
checkpoints, and the verifier keys that `verify`, `prove` and `witness` trust.

The signing key comes from the environment variable `log.signing_key_env` names, or from a file
(`log.signing_key_file`; with an SQLite store and neither set, a file beside the database, which the embedded
default makes on its first start). Never from the database: whoever can write the database must not be able to
sign. Key text formats are `proxy/audit/note.py`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

from proxy.audit.note import (
    LOG_SIGNATURE,
    NoteError,
    Signer,
    Verifier,
    generate_signer,
    parse_signer,
    parse_vkey,
)
from proxy.config import Secrets, Settings, log_key_file
from proxy.errors import ConfigError

log = structlog.get_logger("stackpin.log_keys")


def write_key(path: Path, signer: Signer) -> None:
    """Writes a private key readable by its owner only; refuses to overwrite one."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as e:
        raise ConfigError(f"{path} exists already; a key is never overwritten") from e
    except OSError as e:
        raise ConfigError(f"cannot write the key file {path}: {e.strerror}") from e
    with os.fdopen(descriptor, "w") as sink:
        sink.write(signer.text + "\n")


def parse_log_signer(text: str, where: str) -> Signer:
    try:
        signer = parse_signer(text)
    except NoteError as e:
        raise ConfigError(f"the log's signing key ({where}) is unusable: {e}") from e
    if signer.kind != LOG_SIGNATURE:
        raise ConfigError(f"the log's signing key ({where}) is a witness's cosigner key, not a log key")
    return signer


def serving_signer(settings: Settings, secrets: Secrets) -> Signer:
    """The key a proxy signs checkpoints with; makes the embedded default's on its first start."""
    where = (
        f"${settings.log.signing_key_env}" if settings.log.signing_key_env else str(log_key_file(settings))
    )
    if secrets.log_signing_key is not None:
        return parse_log_signer(secrets.log_signing_key.get_secret_value(), where)
    if settings.log.signing_key_env:
        raise ConfigError(f"log.signing_key_env names {settings.log.signing_key_env}, which is not set")
    path = log_key_file(settings)
    if path is None:
        raise ConfigError(
            "the log signs its checkpoints with a key of its own: set [log] signing_key_env or signing_key_file "
            "(make a key with `stackpin keygen NAME`)"
        )
    if settings.log.signing_key_file is not None:
        raise ConfigError(
            f"log.signing_key_file {path} does not exist (make a key with `stackpin keygen NAME`)"
        )
    signer = generate_signer(f"stackpin.local/{os.urandom(4).hex()}")
    try:
        write_key(path, signer)
    except ConfigError:
        if path.is_file():  # another proxy on this database made it a moment ago
            return parse_log_signer(path.read_text().strip(), str(path))
        raise
    # The verifier key is public, and what verify, prove and witness are given; the log's processor redacts any
    # field named like a key, so it goes under a name that is not one.
    log.warning("log_key_created", path=str(path), verifier=signer.verifier.vkey)
    return signer


def trusted_log_keys(settings: Settings, secrets: Secrets, given: list[str]) -> list[Verifier]:
    """The log keys to verify with: those given on the command line, else those configured, else the public half
    of the signing key when this machine holds it (a key kept elsewhere is the stronger check)."""
    try:
        keys = [parse_vkey(text) for text in given or settings.log.public_keys]
    except NoteError as e:
        raise ConfigError(f"--log-key: {e}") from e
    if keys:
        return keys
    if secrets.log_signing_key is not None:
        return [parse_log_signer(secrets.log_signing_key.get_secret_value(), "the configured key").verifier]
    return []
