"""The `ollama` kind: an Ollama server, serving the model its `[[replicas]]` entry names, through its `/v1` routes.

    GET  /api/version   `version`
    POST /api/show      {"model": NAME} -> `details` (`format`, `family`, `parameter_size`, `quantization_level`),
                        `model_info` (`general.architecture`, `general.parameter_count`, `<arch>.context_length`),
                        `parameters` (the Modelfile's, as text), `template`, `modified_at`
    GET  /api/tags      each local model's `name` and `digest` (the SHA-256 of its manifest, which names its
                        weights' blob by digest)

Ollama serves many models from one server, so the entry names the one this replica stands for (`model`). The
manifest's digest names the weights exactly, so it is kept; the weights' own SHA-256 is not reported. Its OpenAI
routes give no token ids; replays compare its answers whole.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from proxy.errors import ReplicaRejected, StackpinError, relayed_error
from proxy.replicas.kinds.base import Target
from proxy.replicas.kinds.engine import Documents, Engine, Fetch, reported_stack
from proxy.stack import Stack


class Ollama(Engine):
    name = "ollama"
    needs_model = True
    documents = (
        Fetch("/api/version"),
        Fetch("/api/show", body=lambda target, _: {"model": target.model}),
        Fetch("/api/tags", optional=True),
    )

    def rejected(self, error: ReplicaRejected) -> StackpinError:
        """Its errors are `{"error": "<text>"}`, which the transport quotes whole: the text is the message."""
        message = relayed_error(error.replica_body)["error"]["message"]
        try:
            text = orjson.loads(message).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            text = None
        if isinstance(text, str):
            error = ReplicaRejected(
                error.status, {"error": {"message": text, "type": "invalid_request_error"}}
            )
        return super().rejected(error)

    def stack_of(self, documents: Documents, target: Target) -> Stack:
        assert target.model is not None  # validate() requires it
        return ollama_stack(documents, target.model)


def ollama_stack(documents: Documents, model: str) -> Stack:
    show: dict[str, Any] = documents["/api/show"]
    details = show.get("details") or {}
    info = show.get("model_info") or {}
    architecture = info.get("general.architecture")
    tags = documents.get("/api/tags") or {}
    digest = next(
        (m.get("digest") for m in tags.get("models", []) if m.get("name") in (model, f"{model}:latest")), None
    )
    template = show.get("template")
    return reported_stack(
        engine="ollama",
        version=documents["/api/version"]["version"],
        model=model,
        quantisation=details.get("quantization_level"),
        hardware=None,
        batching={},
        details={
            "manifest_digest": digest,
            "format": details.get("format"),
            "family": details.get("family"),
            "parameter_size": details.get("parameter_size"),
            "context_length": info.get(f"{architecture}.context_length") if architecture else None,
            "parameters": show.get("parameters"),
            "template_sha256": hashlib.sha256(template.encode()).hexdigest()
            if isinstance(template, str)
            else None,
        },
    )


KIND = Ollama()
