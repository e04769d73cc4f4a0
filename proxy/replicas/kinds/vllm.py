"""The `vllm` kind: a vLLM server, whose stack is read from what the running server says about itself.

    GET /version     `version`
    GET /v1/models   the served model: `data[0].id`, `root` (the weights' path or hub name), `max_model_len`
    GET /metrics     the info gauges: `vllm:cache_config_info` (block size, cache dtype, prefix caching, ...) and
                     any other `vllm:*_info` gauge the release exports, each gauge's labels as reported

A forwarded request asks for the answer's token ids (`return_token_ids`, which vLLM adds to OpenAI's fields) and
for the sampled tokens' logprobs, so that a replay compares bits. vLLM reports no digest of its weights, no torch or
CUDA version, and no batch-invariance mode on its CPU build; docs/engines.md lists what the stack says it lacks.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from proxy.endpoints import CHAT, COMPLETIONS
from proxy.replicas.kinds.base import Target
from proxy.replicas.kinds.engine import Documents, Engine, Fetch, dtype_name, reported_stack
from proxy.stack import Stack

METRICS_PREFIX = "vllm:"
# Labels of an info gauge that name the process or its moment, not how it computes.
VOLATILE_LABELS = frozenset(
    {"engine", "model_name", "num_gpu_blocks", "num_cpu_blocks", "gpu_memory_utilization"}
)


class Vllm(Engine):
    name = "vllm"
    documents = (Fetch("/version"), Fetch("/v1/models"), Fetch("/metrics", text=True))

    def stack_of(self, documents: Documents, target: Target) -> Stack:
        return vllm_stack(documents)

    def forwarded(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        body = super().forwarded(endpoint, body)
        if endpoint in (CHAT, COMPLETIONS) and "return_token_ids" not in body:
            return {**body, "return_token_ids": True}
        return body


def info_gauges(metrics: str) -> dict[str, dict[str, str]]:
    """Every `vllm:*_info` gauge's labels, by the gauge's name without prefix and suffix (`cache_config`)."""
    gauges: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(metrics):
        if not family.name.startswith(METRICS_PREFIX) or not family.name.endswith("_info"):
            continue
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in VOLATILE_LABELS}
            gauges[family.name.removeprefix(METRICS_PREFIX).removesuffix("_info")] = labels
    return gauges


def vllm_stack(documents: Documents) -> Stack:
    served = documents["/v1/models"]["data"][0]
    gauges = info_gauges(documents["/metrics"])
    cache = gauges.get("cache_config", {})
    model_config = gauges.get("model_config", {})
    return reported_stack(
        engine="vllm",
        version=documents["/version"]["version"],
        model=served["id"],
        quantisation=model_config.get("quantization") or dtype_name(model_config.get("dtype")),
        hardware=None,
        batching=cache,
        details={
            "root": served.get("root"),
            "max_model_len": served.get("max_model_len"),
            "info": {name: labels for name, labels in sorted(gauges.items()) if name != "cache_config"},
        },
    )


KIND = Vllm()
