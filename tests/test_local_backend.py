"""The embedded default's replicas: one backend process a kernel mode, named so that records tell them apart, and
none when the local backend is off."""

from __future__ import annotations

from proxy.config import Settings
from proxy.replicas.local_backend import local_backends_for


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
