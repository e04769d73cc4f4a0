"""The embedded default's replicas: one backend process a kernel mode, named so that records tell them apart, and
none when the local backend is off; and what the proxy's [local_backend] settings become on each one's command line
for `stackpin-backend serve`. (The backend started for real, end to end: tests/test_embedded_default.py.)"""

from __future__ import annotations

from pathlib import Path

from proxy.config import LocalBackendSettings, Settings
from proxy.replicas.local_backend import local_backends_for, serve_command


def test_one_mode_is_the_replica_the_embedded_default_always_had() -> None:
    (only,) = local_backends_for(Settings(local_backend={"enabled": "on"}))
    assert (only.name, only.kernel_mode) == ("local-cpu", "batch_invariant")
    (default,) = local_backends_for(Settings(local_backend={"enabled": "on", "kernel_mode": "default"}))
    assert (default.name, default.kernel_mode) == ("local-cpu", "default")


def test_several_modes_are_a_replica_each_named_by_its_mode_on_one_checkpoint() -> None:
    both = local_backends_for(
        Settings(local_backend={"enabled": "on", "kernel_modes": ["batch_invariant", "default"]})
    )
    assert [(b.name, b.kernel_mode) for b in both] == [
        ("local-cpu-batch_invariant", "batch_invariant"),
        ("local-cpu-default", "default"),
    ]
    assert both[0].settings is both[1].settings, "the same model, dtype and timeouts for each"


def test_off_is_none() -> None:
    assert local_backends_for(Settings(local_backend={"enabled": "off", "kernel_modes": ["default"]})) == []


def flags(command: list[str]) -> dict[str, str]:
    serve = command.index("serve")
    return dict(zip(command[serve + 1 :: 2], command[serve + 2 :: 2], strict=True))


def test_the_kv_cache_is_sized_automatically_unless_local_backend_kv_cache_mb_says_otherwise() -> None:
    model, ready = Path("/models/m.gguf"), Path("/tmp/ready")
    default = flags(serve_command(LocalBackendSettings(), "batch_invariant", model, "m", ready))
    assert default["--kv-cache-mb"] == "auto"
    sized = flags(serve_command(LocalBackendSettings(kv_cache_mb=2048), "default", model, None, ready))
    assert sized["--kv-cache-mb"] == "2048.0" and "--model-name" not in sized
    assert (default["--kernel-mode"], sized["--kernel-mode"]) == ("batch_invariant", "default")
    assert (default["--device"], default["--port"], default["--model"]) == ("cpu", "0", str(model))
