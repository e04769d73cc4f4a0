"""The embedded backend's command line: what the proxy's [local_backend] settings become for `stackpin-backend
serve`. (The backend started for real, end to end: tests/test_embedded_default.py.)"""

from __future__ import annotations

from pathlib import Path

from proxy.config import LocalBackendSettings
from proxy.replicas.local_backend import serve_command


def flags(command: list[str]) -> dict[str, str]:
    serve = command.index("serve")
    return dict(zip(command[serve + 1 :: 2], command[serve + 2 :: 2], strict=True))


def test_the_kv_cache_is_sized_automatically_unless_local_backend_kv_cache_mb_says_otherwise() -> None:
    model, ready = Path("/models/m.gguf"), Path("/tmp/ready")
    default = flags(serve_command(LocalBackendSettings(), model, "m", ready))
    assert default["--kv-cache-mb"] == "auto"
    sized = flags(serve_command(LocalBackendSettings(kv_cache_mb=2048), model, None, ready))
    assert sized["--kv-cache-mb"] == "2048.0" and "--model-name" not in sized
    assert (default["--device"], default["--port"], default["--model"]) == ("cpu", "0", str(model))
