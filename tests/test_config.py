"""Configuration: a TOML file with environment overrides, validated once, with secrets resolved from the
environment and never from the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import hash_api_key, load_settings
from proxy.errors import ConfigError

FULL = """
[server]
host = "127.0.0.1"
port = 9000

[store]
url = "postgresql+asyncpg://stackpin@127.0.0.1:5432/stackpin"

[[replicas]]
name = "local"
url = "http://127.0.0.1:8001/"

[[replicas]]
name = "openai"
url = "https://api.example.invalid"
api_key_env = "UPSTREAM_KEY"
stack = { model = "gpt-4o-mini-2024-07-18" }

[prompts]
"support@3" = "You are a careful support agent."

[routes.support-bot]
model = "qwen3-8b"
prompt = "support@3"

[[tenants]]
name = "acme"
api_key_env = "ACME_KEY"
"""
ENV = {"UPSTREAM_KEY": "sk-up", "ACME_KEY": "sk-acme"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stackpin.toml"
    path.write_text(text)
    return path


def test_a_full_file_loads_and_resolves_secrets(tmp_path: Path) -> None:
    settings, secrets = load_settings(write(tmp_path, FULL), ENV)
    assert settings.server.port == 9000
    assert settings.replicas[0].url == "http://127.0.0.1:8001"
    assert settings.replicas[1].stack is not None and settings.replicas[1].stack.kernel_mode == "unknown"
    assert secrets.replica_keys["openai"].get_secret_value() == "sk-up"
    assert secrets.tenant_key_hashes == {hash_api_key("sk-acme"): "acme"}
    assert "sk-up" not in repr(secrets)
    assert settings.route_pins()["support-bot"].prompt == "support@3"


def test_the_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STACKPIN_STORE__URL", "sqlite+aiosqlite:///elsewhere.db")
    monkeypatch.setenv("STACKPIN_SERVER__PORT", "9100")
    monkeypatch.setenv("STACKPIN_SERVER__WORKERS", "4")
    settings, _ = load_settings(write(tmp_path, FULL), ENV)
    assert settings.store.url == "sqlite+aiosqlite:///elsewhere.db"
    assert settings.server.port == 9100
    assert settings.server.workers == 4
    settings, _ = load_settings(write(tmp_path, FULL), ENV, server={"workers": 2})
    assert settings.server.workers == 2, "--workers wins over the environment"


def test_no_file_is_the_embedded_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings, secrets = load_settings(None, {})
    assert settings.server.loopback_only and settings.store.url.startswith("sqlite")
    assert not secrets.tenant_key_hashes


def test_the_embedded_default_serves_one_kernel_mode_or_several_side_by_side(tmp_path: Path) -> None:
    settings, _ = load_settings(write(tmp_path, ""), {})
    assert settings.local_backend.modes == ["batch_invariant"]
    both = '[local_backend]\nkernel_modes = ["batch_invariant", "default"]\n'
    settings, _ = load_settings(write(tmp_path, both), {})
    assert settings.local_backend.modes == ["batch_invariant", "default"]


@pytest.mark.parametrize(
    ("text", "environ", "fragment"),
    [
        (FULL, {"ACME_KEY": "k"}, "UPSTREAM_KEY is not set"),
        ('[server]\nhost = "0.0.0.0"\n', {}, "no [[tenants]]"),
        ('[prompts]\n"support" = "x"\n', {}, "name@N"),
        ('[routes.r]\nprompt = "missing@1"\n', {}, "does not define"),
        ('[routes.r]\ncolour = "blue"\n', {}, "unknown pin keys"),
        ('[[replicas]]\nname = "x"\nurl = "ftp://nope"\n', {}, "http://"),
        ("[server]\nport = 'eighty'\n", {}, "server.port"),
        ("[server]\nworkers = 0\n", {}, "server.workers"),
        ("[sever]\n", {}, "sever"),
        ('[local_backend]\nkv_cache_mb = "lots"\n', {}, "local_backend.kv_cache_mb"),
        ('[server]\ndefault_route = "r"\n', {}, "names no route"),
        (
            '[[replicas]]\nname = "x"\nurl = "http://a"\nendpoints = ["/v1/chat/completions"]\n',
            {},
            "proves its own",
        ),
        (
            '[[replicas]]\nname = "x"\nurl = "http://a"\nstack = { model = "m" }\nendpoints = ["/v1/images"]\n',
            {},
            "unknown endpoints",
        ),
        (
            '[[replicas]]\nname = "x"\nurl = "http://a"\nstack = { model = "m", embedding = {} }\n',
            {},
            "schema = 2",
        ),
        ('[local_backend]\nkernel_modes = ["default", "default"]\n', {}, "names a mode twice"),
        ("[local_backend]\nkernel_modes = []\n", {}, "local_backend.kernel_modes"),
        ('[local_backend]\nkernel_modes = ["fast"]\n', {}, "local_backend.kernel_modes"),
    ],
)
def test_bad_configuration_names_what_to_fix(
    tmp_path: Path, text: str, environ: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_settings(write(tmp_path, text), environ)


def test_the_audit_pages_operators_are_tenants_and_its_session_key_comes_from_the_environment(
    tmp_path: Path,
) -> None:
    path = tmp_path / "stackpin.toml"
    tenants = '[[tenants]]\nname = "ops"\napi_key_env = "OPS_KEY"\n'
    path.write_text(tenants + '[ui]\noperators = ["nobody"]\n')
    with pytest.raises(ConfigError, match=r"ui.operators names \['nobody'\]"):
        load_settings(path, {"OPS_KEY": "k"})
    path.write_text(tenants + '[ui]\noperators = ["ops"]\nsession_key_env = "UI_KEY"\n')
    with pytest.raises(ConfigError, match="UI_KEY is not set"):
        load_settings(path, {"OPS_KEY": "k"})
    settings, secrets = load_settings(path, {"OPS_KEY": "k", "UI_KEY": "s3cret"})
    assert settings.ui.operators == ["ops"] and secrets.ui_session_key is not None
    assert "s3cret" not in repr(secrets)
