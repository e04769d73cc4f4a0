"""Specification of pinned_backend.metrics: the documented names, on the registry the caller gives."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pinned_backend.engine import StepStats
from pinned_backend.metrics import BackendMetrics


def test_two_registries_never_share_a_counter() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    BackendMetrics(first).observe_request("/v1/completions", 200)
    BackendMetrics(second)
    sample = {"endpoint": "/v1/completions", "code": "200"}
    assert first.get_sample_value("stackpin_backend_requests_total", sample) == 1
    assert second.get_sample_value("stackpin_backend_requests_total", sample) is None


def test_a_step_updates_every_engine_metric() -> None:
    registry = CollectorRegistry()
    metrics = BackendMetrics(registry)
    metrics.observe_step(
        StepStats(
            0.02,
            3,
            prefill_tokens=10,
            decode_tokens=2,
            running=3,
            waiting=4,
            kv_used_ratio=0.5,
            launch="graph",
            padded_tokens=6,
        )
    )
    value = registry.get_sample_value
    assert value("stackpin_backend_steps_total", {"launch": "graph"}) == 1
    assert value("stackpin_backend_padding_tokens_total") == 6
    assert value("stackpin_backend_tokens_total", {"phase": "prefill"}) == 10
    assert value("stackpin_backend_tokens_total", {"phase": "decode"}) == 2
    assert value("stackpin_backend_running_sequences") == 3
    assert value("stackpin_backend_queue_depth") == 4
    assert value("stackpin_backend_kv_cache_used_ratio") == 0.5
    assert value("stackpin_backend_step_seconds_count") == 1
    assert value("stackpin_backend_batch_size_sum") == 3


def test_info_carries_the_stack_labels() -> None:
    registry = CollectorRegistry()
    stack = {"model": "m", "kernel_mode": "batch_invariant", "hardware": "cpu-x86_64-avx512"}
    BackendMetrics(registry).set_stack(stack, "f" * 64)
    labels = {
        "fingerprint": "f" * 64,
        "model": "m",
        "kernel_mode": "batch_invariant",
        "hardware": "cpu-x86_64-avx512",
    }
    assert registry.get_sample_value("stackpin_backend_info", labels) == 1


def test_an_idle_step_updates_gauges_but_not_step_histograms() -> None:
    registry = CollectorRegistry()
    BackendMetrics(registry).observe_step(StepStats(0.0, 0, 0, 0, running=0, waiting=2, kv_used_ratio=0.0))
    assert registry.get_sample_value("stackpin_backend_queue_depth") == 2
    assert registry.get_sample_value("stackpin_backend_step_seconds_count") == 0
    assert registry.get_sample_value("stackpin_backend_steps_total", {"launch": "eager"}) is None
