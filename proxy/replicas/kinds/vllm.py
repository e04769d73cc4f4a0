"""The `vllm` kind: a vLLM server, whose stack is read from what the running server says about itself.

    GET  /version          `version`
    GET  /v1/models        the served model: `data[0].id`, `root` (the weights' path or hub name), `max_model_len`
    GET  /metrics          `vllm:cache_config_info`'s labels: block size, KV-cache dtype, prefix caching, ...
    POST /v1/completions   one greedy token, for the `system_fingerprint` every answer carries:
                           `vllm-<version>[-<parallelism>]-<first 8 hex of its configuration's hash>`, a hash that
                           covers the model, its dtype and quantisation, its length limit, attention backend and more
    GET  /server_info?config_format=json   only with VLLM_SERVER_DEV_MODE=1: the whole configuration (dtype,
                           quantisation, device, scheduler) and environment (torch, CUDA, driver, GPU models,
                           VLLM_BATCH_INVARIANT); absent otherwise, and the stack says what it then lacks

Every answer must carry the `system_fingerprint` its stack was read with: one that does not is another
configuration, and is thrown away like a pinned_backend's answer under another fingerprint. A forwarded request asks
for the answer's token ids (`return_token_ids`, vLLM's own field) and the sampled tokens' logprobs, so that a replay
compares bits. vLLM reports no digest of the weights it loaded (its development route `/weight_checker` hashes
every tensor, too costly for every health check), so `weights_sha256` is null; docs/engines.md says why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from proxy.endpoints import CHAT, COMPLETIONS
from proxy.errors import StackMismatch
from proxy.replicas.kinds.base import Target
from proxy.replicas.kinds.engine import Documents, Engine, Fetch, dtype_name, reported_stack
from proxy.stack import Stack

if TYPE_CHECKING:
    from proxy.replicas.registry import ReplicaSnapshot

CACHE_INFO = "vllm:cache_config_info"
# Its labels that say how the KV cache computes; the rest are sizes and this moment's counts.
CACHE_KEYS = (
    "block_size", "cache_dtype", "enable_prefix_caching", "prefix_caching_hash_algo", "sliding_window",
    "kv_cache_dtype_skip_layers", "kv_sharing_fast_prefill", "calculate_kv_scales", "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
)  # fmt: skip
SCHEDULER_KEYS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "policy",
    "async_scheduling",
)
ENVIRONMENT_KEYS = {
    "torch": "torch_version",
    "cuda": "cuda_runtime_version",
    "driver": "nvidia_driver_version",
}
PROBE_KEY = "probe"
SERVER_INFO = "/server_info"


def _probe(target: Target, documents: Documents) -> dict[str, Any]:
    return {
        "model": documents["/v1/models"]["data"][0]["id"],
        "prompt": "0",
        "max_tokens": 1,
        "temperature": 0,
    }


class Vllm(Engine):
    name = "vllm"
    documents = (
        Fetch("/version"),
        Fetch("/v1/models"),
        Fetch("/metrics", text=True),
        Fetch("/v1/completions", body=_probe, key=PROBE_KEY),
        Fetch("/server_info?config_format=json", optional=True, key=SERVER_INFO),
    )

    def stack_of(self, documents: Documents, target: Target) -> Stack:
        return vllm_stack(documents)

    def forwarded(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        body = super().forwarded(endpoint, body)
        if endpoint in (CHAT, COMPLETIONS) and "return_token_ids" not in body:
            return {**body, "return_token_ids": True}
        return body

    def check_answer(
        self, replica: ReplicaSnapshot, stack_header: str | None, body: dict[str, Any] | None
    ) -> None:
        expected = (replica.stack.engine or {}).get("system_fingerprint")
        if body is None or expected is None:
            return  # a stream's headers say nothing; the health checks watch it
        claimed = body.get("system_fingerprint")
        if claimed != expected:
            raise StackMismatch(replica, claimed if isinstance(claimed, str) else None)


def cache_config(metrics: str) -> dict[str, str]:
    """`vllm:cache_config_info`'s labels that say how the KV cache computes (empty when it is not exported)."""
    for family in text_string_to_metric_families(metrics):
        if family.name == CACHE_INFO:
            for sample in family.samples:
                return {key: sample.labels[key] for key in CACHE_KEYS if key in sample.labels}
    return {}


def vllm_stack(documents: Documents) -> Stack:
    served = documents["/v1/models"]["data"][0]
    fingerprint = documents[PROBE_KEY].get("system_fingerprint")
    config, environment, variables = _server_info(documents.get(SERVER_INFO))
    model = config.get("model_config") or {}
    batching: dict[str, Any] = dict(cache_config(documents["/metrics"]))
    scheduler = config.get("scheduler_config") or {}
    batching.update({key: scheduler[key] for key in SCHEDULER_KEYS if key in scheduler})
    if config.get("speculative_config") is not None:
        batching["speculative_config"] = config["speculative_config"]
    invariant = variables.get("VLLM_BATCH_INVARIANT")
    gpus = environment.get("nvidia_gpu_models")
    return reported_stack(
        engine="vllm",
        version=documents["/version"]["version"],
        model=served["id"],
        quantisation=model.get("quantization") or dtype_name(model.get("dtype")),
        hardware=(config.get("device_config") or {}).get("device") or None,
        kernel_mode=None
        if invariant is None
        else ("batch_invariant" if invariant in (True, 1, "1") else "default"),
        batching=batching,
        software=_versions(environment),
        hardware_detail={"gpu_models": gpus} if gpus else None,
        details={
            "system_fingerprint": fingerprint if isinstance(fingerprint, str) else None,
            "root": served.get("root"),
            "max_model_len": served.get("max_model_len"),
            "configuration": "reported" if config else "not reported (VLLM_SERVER_DEV_MODE is off)",
        },
    )


def _versions(environment: dict[str, Any]) -> dict[str, str | None]:
    """torch's, and CUDA's and the driver's where CUDA is in use (a CPU build still names the CUDA it was built
    against, which computes nothing here)."""
    versions = {key: environment.get(name) or None for key, name in ENVIRONMENT_KEYS.items()}
    if environment.get("is_cuda_available") != "True":
        versions["cuda"] = versions["driver"] = None
    return versions


def _server_info(info: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The configuration, environment and VLLM_* variables of `/server_info`, or empty where it did not answer."""
    if not isinstance(info, dict) or not isinstance(info.get("vllm_config"), dict):
        return {}, {}, {}
    environment, variables = info.get("system_env"), info.get("vllm_env")
    return (
        info["vllm_config"],
        environment if isinstance(environment, dict) else {},
        variables if isinstance(variables, dict) else {},
    )


KIND = Vllm()
