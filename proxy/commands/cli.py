"""`stackpin`: serve the proxy, manage its audit store, replay (a record or a slice), audit, list, probe and study
answers, and run the heartbeat sidecar that registers a backend in a fleet (`stackpin fleet heartbeat`).

Exit codes mean something: `replay` exits 0 when reproduced, 1 when diverged, 2 on error (a slice: 0 when its
agreement meets --require, 1 when not); `study` 0 when every answer is in, 2 on error or when some are missing;
`verify` 0 when the log is intact, 1 when it is not; `prove` 0 when every entry is proven, 1 when one is not;
`erase` 0 when every record named is erased, 1 when one is not; `witness --once` 0 when the checkpoint is
accepted, 1 when refused; `serve --workers N` exits 1 when a worker died; every command exits 2 on a usage or
configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from proxy.app import utc_now
from proxy.audit import AuditError, Witnessed, upgrade_database
from proxy.audit.export import Window
from proxy.audit.keys import trusted_log_keys, write_key
from proxy.audit.note import (
    COSIGNATURE,
    LOG_SIGNATURE,
    NoteError,
    Verifier,
    generate_signer,
    parse_signer,
    parse_vkey,
)
from proxy.audit.receipts import Receipt, ReceiptError, read_receipts
from proxy.commands import prove, slice_command, study_command
from proxy.commands.auditor import audit, list_records, verify
from proxy.commands.erase import erase, erase_expired
from proxy.commands.export import export
from proxy.commands.proxy_client import probe, replay
from proxy.commands.replay_batch import replay_batch
from proxy.commands.witness import HttpLogSource, WitnessStore, follow
from proxy.config import Settings, load_settings, log_secrets, read_settings
from proxy.errors import ConfigError, StackpinError
from proxy.fleet.documents import FleetKeys
from proxy.fleet.heartbeat import run_sidecar
from proxy.fleet.state import FleetState, FleetUnavailable, connect
from proxy.logs import configure_logging
from proxy.process.launch import serve
from proxy.replicas.kinds import StackSource, kind_named
from proxy.replicas.local_backend import SMOLLM2_NAME

EXIT_OK, EXIT_DIVERGED, EXIT_ERROR = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ConfigError, StackpinError, AuditError) as e:
        # What the user can fix: one line, never a traceback.
        print(f"stackpin: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    description, epilog = (" ".join(part.split()) for part in __doc__.split("\n\n")[:2])
    parser = argparse.ArgumentParser(prog="stackpin", description=description, epilog=epilog)
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument(
        "--config", type=Path, help="TOML configuration (default: ./stackpin.toml if present)"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", parents=[config], help="run the proxy")
    serve.add_argument("--host", help="address to listen on (default: [server] host, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default: [server] port, 8080)")
    serve.add_argument(
        "--workers",
        type=int,
        help="processes serving the port, about one per core (default: [server] workers, 1)",
    )
    serve.set_defaults(run=_serve)

    db = commands.add_parser("db", help="the audit store's schema")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser(
        "upgrade", parents=[config], help="migrate the audit store to the newest schema"
    )
    upgrade.set_defaults(run=_db_upgrade)

    log_key = argparse.ArgumentParser(add_help=False)
    log_key.add_argument(
        "--log-key",
        action="append",
        default=[],
        metavar="VKEY",
        help="the log's verifier key to trust (repeatable; default: [log] public_keys)",
    )

    verify = commands.add_parser(
        "verify", parents=[config, log_key], help="check the whole audit log: tree, signatures, witnesses"
    )
    verify.add_argument(
        "--witness",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a witness's store (repeatable)",
    )
    verify.add_argument(
        "--witness-key",
        action="append",
        default=[],
        metavar="VKEY",
        help="a witness's cosigner key (repeatable)",
    )
    verify.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a checkpoint kept elsewhere, to detect a cut or rewritten log (repeatable)",
    )
    verify.add_argument(
        "--receipt",
        action="append",
        default=[],
        type=Path,
        metavar="FILE|DIR",
        help="receipts clients kept (Stackpin-Receipt), one a line; a folder: every file in it (repeatable)",
    )
    verify.set_defaults(run=_verify)

    audit = commands.add_parser(
        "audit", parents=[config, log_key], help="which stack produced an answer, and its proof in the log"
    )
    audit.add_argument("record")
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(run=_audit)

    erase = commands.add_parser(
        "erase",
        parents=[config],
        help="erase records' payloads (requests and answers); the log and every proof stay valid",
    )
    erase.add_argument("records", nargs="*", metavar="RECORD", help="the records whose payloads to erase")
    erase.add_argument("--reason", help="why, kept in the erasure entry (required with RECORD)")
    erase.add_argument(
        "--expired", action="store_true", help="apply every tenant's retention policy now (retention_days)"
    )
    erase.set_defaults(run=_erase)

    export = commands.add_parser(
        "export",
        parents=[config],
        help="the log's entries of a time window with their proofs, for your own tools",
    )
    export.add_argument("--since", required=True, help="ISO 8601 time with its zone (inclusive)")
    export.add_argument("--until", help="ISO 8601 time with its zone (exclusive; default: now)")
    export.add_argument("--tenant", help="only this tenant's entries")
    export.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    export.add_argument(
        "--out", type=Path, metavar="FILE", help="where to write (JSON lines: default stdout)"
    )
    export.set_defaults(run=_export)

    records = commands.add_parser("records", parents=[config], help="list records")
    records.add_argument("--stack", help="fingerprint, or its first characters (the listing shows 12)")
    records.add_argument("--model")
    records.add_argument("--tenant")
    records.add_argument("--since", help="ISO 8601 time with its zone, e.g. 2026-12-01T07:22:00+00:00")
    records.add_argument("--until", help="ISO 8601 time with its zone (exclusive)")
    records.add_argument("--limit", type=int, default=50, help="most records listed (1 to 1000, default 50)")
    records.add_argument("--before", metavar="RECORD", help="the next page: records older than this one")
    records.add_argument("--json", action="store_true")
    records.set_defaults(run=_records)

    client = argparse.ArgumentParser(add_help=False, parents=[config])
    client.add_argument(
        "--url", help="the proxy's base URL (default: from the configuration's server section)"
    )
    client.add_argument(
        "--api-key-env", default="STACKPIN_API_KEY", help="environment variable holding your API key"
    )

    replay = commands.add_parser(
        "replay", parents=[client], help="resend a record's exact request and compare"
    )
    replay.add_argument("record", nargs="?", help="the record to replay (or a slice: see below)")
    replay.add_argument(
        "--batch", metavar="ID", help="replay every answered line of a batch instead of one record"
    )
    replay.add_argument("--on", help="pin of another stack to replay on, e.g. 'kernel_mode=default'")
    replay.add_argument("--json", action="store_true")
    slice_command.add_options(replay)
    replay.set_defaults(run=_replay)

    probe = commands.add_parser(
        "probe", parents=[client], help="send one request N times; count distinct answers"
    )
    probe.add_argument("--model", default=SMOLLM2_NAME, help="default: the embedded default's model")
    probe.add_argument("--prompt", default="Tell me a short story about a lighthouse.")
    probe.add_argument("--pin", help="Stackpin-Pin header value")
    probe.add_argument("-n", "--requests", type=int, default=32)
    probe.add_argument("-c", "--concurrency", type=int, default=8)
    probe.add_argument("--max-tokens", type=int, default=32)
    probe.add_argument("--temperature", type=float, default=0.0)
    probe.add_argument("--json", action="store_true")
    probe.set_defaults(run=_probe)

    study_command.add_parser(commands, client, SMOLLM2_NAME, _study)

    prove = commands.add_parser(
        "prove", parents=[client, log_key], help="show and check that a record's entries are in the log"
    )
    prove.add_argument("record", nargs="?", help="the record (default: the one the receipt names)")
    prove.add_argument(
        "--receipt",
        type=Path,
        metavar="FILE",
        help="the answer's receipt (its Stackpin-Receipt header): checked, then its entry in the checkpoint",
    )
    prove.add_argument(
        "--offline", action="store_true", help="with --receipt: check the receipt's signature only, no proof"
    )
    prove.add_argument(
        "--checkpoint", type=Path, metavar="FILE", help="a checkpoint you kept (default: the proxy's latest)"
    )
    prove.add_argument(
        "--proof", type=Path, metavar="FILE", help="a proof saved earlier (--json); no network"
    )
    prove.add_argument("--json", action="store_true", help="print the proof as JSON, to save it")
    prove.set_defaults(run=_prove)

    witness = commands.add_parser(
        "witness", parents=[client, log_key], help="follow a proxy's checkpoints, refuse a rewrite, cosign"
    )
    witness.add_argument(
        "--store", type=Path, required=True, metavar="FILE", help="this witness's checkpoints"
    )
    witness.add_argument(
        "--key",
        type=Path,
        required=True,
        metavar="FILE",
        help="this witness's cosigner key (stackpin keygen --witness)",
    )
    witness.add_argument("--interval-s", type=float, default=1.0, help="seconds between looks (default 1)")
    witness.add_argument("--once", action="store_true", help="look once and exit: 0 accepted, 1 refused")
    witness.set_defaults(run=_witness)

    keygen = commands.add_parser("keygen", help="make a signing key for the log, or a witness's cosigner key")
    keygen.add_argument("name", help="the key's name; for a log, its origin, e.g. audit.example.com/stackpin")
    keygen.add_argument("--out", type=Path, required=True, help="the private key's file (never overwritten)")
    keygen.add_argument(
        "--witness", action="store_true", help="a witness's cosigner key (C2SP tlog-cosignature)"
    )
    keygen.set_defaults(run=_keygen)

    fleet = commands.add_parser("fleet", help="fleet mode: shared state in Redis")
    fleet_commands = fleet.add_subparsers(dest="fleet_command", required=True)
    heartbeat = fleet_commands.add_parser(
        "heartbeat",
        parents=[config],
        help="beside a replica: describe its stack as its kind does and renew its lease in Redis",
    )
    heartbeat.add_argument(
        "--kind",
        default="stackpin",
        help="the replica's kind (default stackpin: a pinned_backend proving its stack at GET /v1/stack; "
        "an engine's: vllm, sglang, llamacpp, ollama)",
    )
    heartbeat.add_argument("--model", help="for an ollama replica: the model it serves")
    heartbeat.add_argument(
        "--replica-url", required=True, help="the backend's base URL, e.g. http://127.0.0.1:8000"
    )
    heartbeat.add_argument("--name", required=True, help="the replica's name, unique in the fleet")
    heartbeat.add_argument("--redis", help="Redis URL (default: the configuration's [fleet] redis_url)")
    heartbeat.add_argument("--lease-s", type=float, default=15.0, help="lease length in seconds (default 15)")
    heartbeat.add_argument(
        "--interval-s", type=float, help="seconds between beats (default: a third of the lease)"
    )
    heartbeat.set_defaults(run=_fleet_heartbeat)
    lift = fleet_commands.add_parser(
        "lift",
        parents=[config],
        help="lift a replica's quarantine for every proxy, once it serves the intended stack; its records stay marked",
    )
    lift.add_argument("name", help="the quarantined replica's name")
    lift.add_argument("--redis", help="Redis URL (default: the configuration's [fleet] redis_url)")
    lift.add_argument("--json", action="store_true", help="print the lifted quarantine as JSON")
    lift.set_defaults(run=_fleet_lift)
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    """The settings without their secrets: enough for every command but `serve`."""
    return read_settings(args.config)


def _serve(args: argparse.Namespace) -> int:

    given = (("host", args.host), ("port", args.port), ("workers", args.workers))
    flags = {name: value for name, value in given if value is not None}
    settings, secrets = load_settings(args.config, server=flags)
    return serve(settings, secrets)


def _db_upgrade(args: argparse.Namespace) -> int:

    settings = _settings(args)
    upgrade_database(settings.store.url, schema=settings.store.postgres_schema)
    print(f"audit store at {_safe_url(settings.store.url)} is at the newest schema")
    return EXIT_OK


def _log_keys(args: argparse.Namespace, settings: Settings) -> list[Verifier]:

    return trusted_log_keys(settings, log_secrets(settings), args.log_key)


def _vkeys(texts: list[str], option: str) -> list[Verifier]:

    try:
        return [parse_vkey(text) for text in texts]
    except NoteError as e:
        raise ConfigError(f"{option}: {e}") from e


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read: {e.strerror}") from e


def _verify(args: argparse.Namespace) -> int:

    settings = _settings(args)
    cosigners = _vkeys(args.witness_key, "--witness-key")
    witnessed = [held for path in args.witness for held in WitnessStore(path).witnessed(cosigners)]
    witnessed += [
        Witnessed(f"the checkpoint kept in {p}", _read(p, "checkpoint file")) for p in args.checkpoint
    ]
    receipts = [receipt for path in args.receipt for receipt in _receipts(path)]
    return asyncio.run(verify(settings.store, _log_keys(args, settings), witnessed, receipts))


def _receipts(path: Path) -> list[Receipt]:
    """The receipts in a file (one a line), or in every file of a folder."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    try:
        return [r for file in files for r in read_receipts(_read(file, "receipt file"), str(file))]
    except ReceiptError as e:
        raise ConfigError(f"--receipt: {e}") from e


def _audit(args: argparse.Namespace) -> int:

    settings = _settings(args)
    return asyncio.run(audit(settings.store, args.record, _log_keys(args, settings), as_json=args.json))


def _prove(args: argparse.Namespace) -> int:

    settings = _settings(args)
    keys = _log_keys(args, settings)

    def fetch(record: str, size: int | None) -> dict[str, Any]:
        url, api_key = _client_target(args, settings)
        return asyncio.run(prove.fetch_proof(url, api_key, record, size))

    try:
        return prove.run(
            prove.Asked(
                record=args.record,
                receipt=_read(args.receipt, "receipt file") if args.receipt else None,
                checkpoint=_read(args.checkpoint, "checkpoint file") if args.checkpoint else None,
                proof=json.loads(_read(args.proof, "proof file")) if args.proof else None,
                offline=args.offline,
                as_json=args.json,
            ),
            keys,
            fetch,
        )
    except (prove.ProveError, ValueError, KeyError, TypeError) as e:
        print(f"stackpin: {e}", file=sys.stderr)
        return EXIT_ERROR


def _witness(args: argparse.Namespace) -> int:

    settings = _settings(args)
    keys = _log_keys(args, settings)
    if not keys:
        raise ConfigError("witness needs the log's verifier key: --log-key VKEY, or [log] public_keys")
    try:
        signer = parse_signer(_read(args.key, "witness key file"))
    except NoteError as e:
        raise ConfigError(f"--key {args.key}: {e}") from e
    if signer.kind != COSIGNATURE:
        raise ConfigError(
            f"--key {args.key} is a log key; a witness cosigns with `stackpin keygen --witness`"
        )
    if args.interval_s <= 0:
        raise ConfigError("--interval-s must be positive")
    url, api_key = _client_target(args, settings)

    async def run() -> int:
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            source = HttpLogSource(session, url, api_key)
            return await follow(
                source, WitnessStore(args.store), keys, signer, interval_s=args.interval_s, once=args.once
            )

    return asyncio.run(run())


def _keygen(args: argparse.Namespace) -> int:

    try:
        signer = generate_signer(args.name, COSIGNATURE if args.witness else LOG_SIGNATURE)
    except NoteError as e:
        raise ConfigError(str(e)) from e
    write_key(args.out, signer)
    print(signer.verifier.vkey)
    return EXIT_OK


def _erase(args: argparse.Namespace) -> int:

    settings = _settings(args)
    if args.expired:
        if args.records:
            raise ConfigError("erase either RECORD... or --expired, not both")
        return asyncio.run(erase_expired(settings, utc_now))
    if not args.records:
        raise ConfigError("name the records to erase, or --expired to apply the retention policies")
    if not args.reason or not args.reason.strip():
        raise ConfigError("--reason is required: it is kept in the log with the erasure")
    return asyncio.run(erase(settings, args.records, args.reason.strip(), utc_now))


def _export(args: argparse.Namespace) -> int:

    since = _moment("--since", args.since)
    assert since is not None
    window = Window(since, _moment("--until", args.until), args.tenant)
    return asyncio.run(export(_settings(args).store, window, args.format, args.out))


def _records(args: argparse.Namespace) -> int:

    if not 1 <= args.limit <= 1000:
        raise ConfigError(f"--limit must be between 1 and 1000, got {args.limit}")
    filters: dict[str, Any] = {
        "fingerprint": args.stack,
        "model": args.model,
        "tenant": args.tenant,
        "since": _moment("--since", args.since),
        "until": _moment("--until", args.until),
        "limit": args.limit,
        "before": args.before,
    }
    return asyncio.run(list_records(_settings(args).store, filters, as_json=args.json))


def _moment(option: str, text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"{option} must be an ISO 8601 time, e.g. 2026-12-01T07:22:00+00:00; got {text!r}"
        ) from None
    if moment.tzinfo is None:
        raise ConfigError(f"{option} must carry its time zone, e.g. {text}+00:00 or {text}Z")
    return moment


def _replay(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if slice_command.wants_slice(args):
        return slice_command.run(args, settings, _client_target(args, settings), _moment)
    if args.batch is not None:
        if args.record is not None:
            raise ConfigError("replay takes a RECORD or --batch ID, not both")
        return asyncio.run(
            replay_batch(_client_target(args, settings), args.batch, on=args.on, as_json=args.json)
        )
    if args.record is None:
        raise ConfigError(
            "name the RECORD to replay, a batch with --batch ID, or a slice of records with --since (and --model, "
            "--stack, ...)"
        )
    return asyncio.run(replay(_client_target(args, settings), args.record, on=args.on, as_json=args.json))


def _probe(args: argparse.Namespace) -> int:

    return asyncio.run(probe(_client_target(args, _settings(args)), args))


def _study(args: argparse.Namespace) -> int:
    settings = _settings(args)
    return study_command.run(args, settings, _client_target(args, settings))


def _fleet_redis_url(args: argparse.Namespace, settings: Settings, command: str) -> str:
    redis_url: str | None = args.redis or settings.fleet.redis_url
    if not redis_url:
        raise ConfigError(f"fleet {command} needs Redis: pass --redis URL or set [fleet] redis_url")
    if not re.match(r"^(redis|rediss|unix)://", redis_url):
        raise ConfigError(f"--redis must start with redis://, rediss:// or unix://, got {redis_url!r}")
    return redis_url


def _fleet_heartbeat(args: argparse.Namespace) -> int:

    settings = _settings(args)
    redis_url = _fleet_redis_url(args, settings, "heartbeat")
    if not re.match(r"^https?://[^\s/]+", args.replica_url):
        raise ConfigError(f"--replica-url must start with http:// or https://, got {args.replica_url!r}")
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", args.name):
        raise ConfigError(f"--name must be letters, digits, '.', '_' or '-', got {args.name!r}")
    try:
        kind = kind_named(args.kind)
    except ValueError as e:
        raise ConfigError(f"--kind: {e}") from e
    if kind.source is StackSource.DECLARED:
        raise ConfigError(
            f"--kind {args.kind}: its stack is declared in configuration; no sidecar describes it"
        )
    if (args.model is None) == (args.kind == "ollama"):
        raise ConfigError("--model names the model of an ollama replica, and only of one")
    interval_s = args.interval_s if args.interval_s is not None else args.lease_s / 3
    if args.lease_s <= 0 or not 0 < interval_s < args.lease_s:
        raise ConfigError("--lease-s must be positive and --interval-s shorter than the lease")
    configure_logging(settings.log_level)
    asyncio.run(
        run_sidecar(
            redis_url,
            key_prefix=settings.fleet.key_prefix,
            name=args.name,
            replica_url=args.replica_url,
            lease_s=args.lease_s,
            interval_s=interval_s,
            timeout_s=min(settings.fleet.timeout_s, interval_s),
            clock=utc_now,
            kind=kind,
            model=args.model,
        )
    )
    return EXIT_OK


def _fleet_lift(args: argparse.Namespace) -> int:

    settings = _settings(args)
    redis_url = _fleet_redis_url(args, settings, "lift")

    async def lift() -> str | None:
        state = FleetState(
            connect(redis_url, timeout_s=settings.fleet.timeout_s), FleetKeys(settings.fleet.key_prefix)
        )
        try:
            return await state.lift(args.name)
        finally:
            await state.close()

    try:
        note = asyncio.run(lift())
    except FleetUnavailable as e:
        print(f"stackpin: {e}", file=sys.stderr)
        return EXIT_ERROR
    if note is None:
        print(f"stackpin: {args.name} has no quarantine in the fleet; nothing lifted", file=sys.stderr)
        return EXIT_ERROR
    try:
        detail = json.loads(note)
    except ValueError:
        detail = None
    if args.json:
        print(json.dumps({"lifted": args.name, "quarantine": detail if detail is not None else note}))
        return EXIT_OK
    what = (
        f"{detail.get('reason')}, registered {detail.get('registered')}, observed {detail.get('observed')}, "
        f"placed {detail.get('at')} by {detail.get('by')}"
        if isinstance(detail, dict)
        else f"an unreadable note: {note[:200]}"
    )
    print(
        f"lifted the quarantine on {args.name} ({what}); it stays out of rotation until its sidecar registers and "
        "leases the stack it serves now, then every proxy takes it back at its next sync; the records it marked "
        "stay marked"
    )
    return EXIT_OK


def _client_target(args: argparse.Namespace, settings: Settings) -> tuple[str, str | None]:

    url = args.url or f"http://{settings.server.host}:{settings.server.port}"
    return url.rstrip("/"), os.environ.get(args.api_key_env) or None


def _safe_url(url: str) -> str:
    """A database URL without its password, for messages."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        credentials, _, host = rest.rpartition("@")
        user = credentials.split(":", 1)[0]
        return f"{scheme}{sep}{user}:***@{host}"
    return url


if __name__ == "__main__":
    sys.exit(main())
