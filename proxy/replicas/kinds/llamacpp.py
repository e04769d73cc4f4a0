"""The `llamacpp` kind: llama.cpp's `llama-server`, whose stack is read from what it reports about itself.

    GET /props       `model_path`, `model_alias`, `build_info` (the build, e.g. "b4739-Debian"), `total_slots`
                     (parallel sequences), `default_generation_settings.n_ctx` and its `params`, `chat_template`
    GET /v1/models   `data[0].id` and `data[0].meta`: `n_params`, `n_ctx_train`, `n_vocab`, `n_embd`, `size`

It serves one GGUF file; it reports neither the file's digest nor its tensor types, so the stack's `quantisation`
is "unknown" and its weights digest null; the chat template's SHA-256 is kept, since it decides the prompt the model
sees. Its OpenAI logprob entries carry each token's `id`, read as the answer's token ids.
"""

from __future__ import annotations

import hashlib
from typing import Any

from proxy.replicas.kinds.base import Target
from proxy.replicas.kinds.engine import Documents, Engine, Fetch, reported_stack
from proxy.stack import Stack


class Llamacpp(Engine):
    name = "llamacpp"
    documents = (Fetch("/props"), Fetch("/v1/models"))

    def stack_of(self, documents: Documents, target: Target) -> Stack:
        return llamacpp_stack(documents)


def llamacpp_stack(documents: Documents) -> Stack:
    props: dict[str, Any] = documents["/props"]
    model = documents["/v1/models"]["data"][0]
    settings = props.get("default_generation_settings") or {}
    template = props.get("chat_template")
    return reported_stack(
        engine="llama.cpp",
        version=props.get("build_info") if isinstance(props.get("build_info"), str) else None,
        model=model["id"],
        quantisation=None,
        hardware=None,
        batching={"total_slots": props.get("total_slots"), "n_ctx": settings.get("n_ctx")},
        details={
            "model_path": props.get("model_path"),
            "meta": model.get("meta"),
            "chat_template_sha256": (
                hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None
            ),
        },
    )


KIND = Llamacpp()
