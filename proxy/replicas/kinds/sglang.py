"""The `sglang` kind: an SGLang server, whose stack is read from what it reports about itself.

    GET /get_server_info   (newer releases: /server_info) the server's arguments, flattened: `model_path`,
                           `served_model_name`, `dtype`, `quantization`, `kv_cache_dtype`, `context_length`,
                           `device`, `attention_backend`, `sampling_backend`, `max_running_requests`,
                           `chunked_prefill_size`, `schedule_policy`, `disable_radix_cache`, `tp_size`,
                           `enable_deterministic_inference`, and `version`
    GET /get_model_info    `model_path`, `is_generation`, `weight_version`

`enable_deterministic_inference` (SGLang's batch-invariant kernels) is the stack's kernel mode. SGLang reports no
digest of its weights and no torch or CUDA version (docs/engines.md lists what each engine leaves out).
"""

from __future__ import annotations

from typing import Any

from proxy.endpoints import CHAT, COMPLETIONS, EMBEDDINGS
from proxy.replicas.kinds.base import Target
from proxy.replicas.kinds.engine import Documents, Engine, Fetch, dtype_name, reported_stack
from proxy.stack import Stack

# Server arguments that change how a batch is computed or what an answer can be; the rest (ports, log levels,
# timeouts) change neither.
SERVER_KEYS = (
    "attention_backend", "sampling_backend", "max_running_requests", "max_total_tokens", "chunked_prefill_size",
    "max_prefill_tokens", "schedule_policy", "disable_radix_cache", "disable_cuda_graph", "tp_size", "dp_size",
    "ep_size", "kv_cache_dtype", "speculative_algorithm", "random_seed", "enable_deterministic_inference",
)  # fmt: skip


class Sglang(Engine):
    name = "sglang"
    documents = (
        Fetch("/get_server_info", optional=True),
        Fetch("/server_info", optional=True),
        Fetch("/get_model_info"),
    )

    def endpoints(self, declared: list[str] | None) -> frozenset[str]:
        return frozenset({CHAT, COMPLETIONS, EMBEDDINGS})

    def stack_of(self, documents: Documents, target: Target) -> Stack:
        return sglang_stack(documents)


def sglang_stack(documents: Documents) -> Stack:
    info = documents.get("/server_info") or documents.get("/get_server_info")
    if not isinstance(info, dict):
        raise ValueError("neither /server_info nor /get_server_info answered")
    model_info: dict[str, Any] = documents["/get_model_info"]
    deterministic = info.get("enable_deterministic_inference")
    return reported_stack(
        engine="sglang",
        version=_text(info.get("version")),
        model=_text(info.get("served_model_name")) or model_info["model_path"],
        quantisation=_text(info.get("quantization")) or dtype_name(info.get("dtype")),
        hardware=_text(info.get("device")),
        kernel_mode=None if deterministic is None else ("batch_invariant" if deterministic else "default"),
        batching={
            key: info[key] for key in SERVER_KEYS if key in info and key != "enable_deterministic_inference"
        },
        details={
            "model_path": model_info.get("model_path", info.get("model_path")),
            "weight_version": model_info.get("weight_version"),
            "context_length": info.get("context_length"),
        },
    )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


KIND = Sglang()
