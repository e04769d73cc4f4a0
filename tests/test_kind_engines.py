"""The reporting engines SGLang, llama.cpp and Ollama: a stack built from what each server says about itself.

Each engine's documents are fixtures written from its documented field names (tests/data/engines/, marked there),
served on loopback as the engine serves them; vLLM, which runs here, has its own module against the real server.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from proxy.config import ReplicaSettings
from proxy.errors import ReplicaUnavailable
from proxy.replicas.kinds import KINDS, StackSource, kind_named
from proxy.replicas.kinds.base import Target
from proxy.replicas.kinds.llamacpp import llamacpp_stack
from proxy.replicas.kinds.ollama import ollama_stack
from proxy.replicas.kinds.sglang import sglang_stack
from tests.support.engine_documents import EngineDocuments, documents_of
from tests.support.proxy_harness import running_proxy


@pytest.fixture
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[EngineDocuments]:
    server = EngineDocuments(documents_of(request.param))
    await server.start()
    yield server
    await server.stop()


def test_sglang_reports_its_model_dtype_device_version_and_deterministic_mode() -> None:
    stack = sglang_stack(documents_of("sglang"))
    assert (stack.model, stack.quantisation, stack.hardware) == ("qwen3-8b", "bf16", "cuda")
    assert stack.kernel_mode == "batch_invariant"  # enable_deterministic_inference
    assert stack.software["backend"] == "sglang 0.5.4" and stack.software["torch"] is None
    assert stack.batching["attention_backend"] == "flashinfer" and "port" not in stack.batching
    assert stack.engine is not None and stack.engine["model_path"] == "Qwen/Qwen3-8B"
    assert "weights_sha256" in stack.engine["unreported"] and stack.weights_sha256 is None


def test_sglang_reads_the_newer_server_info_route_and_says_default_kernels_when_not_deterministic() -> None:
    documents = documents_of("sglang")
    info = {**documents.pop("/get_server_info"), "enable_deterministic_inference": False}
    stack = sglang_stack({**documents, "/server_info": info})
    assert stack.kernel_mode == "default"


def test_llamacpp_keeps_its_build_slots_context_and_chat_template_and_says_what_it_cannot_report() -> None:
    stack = llamacpp_stack(documents_of("llamacpp"))
    assert stack.model == "smollm2" and stack.software["backend"] == "llama.cpp b4739-7ad0779f"
    assert stack.batching == {"total_slots": 4, "n_ctx": 4096}
    assert stack.engine is not None and len(stack.engine["chat_template_sha256"]) == 64
    assert {"quantisation", "hardware", "kernel_mode", "weights_sha256"} <= set(stack.engine["unreported"])
    assert stack.quantisation == "unknown"


def test_ollama_describes_the_model_its_entry_names_with_its_manifest_digest() -> None:
    stack = ollama_stack(documents_of("ollama"), "smollm2:135m")
    assert (stack.model, stack.quantisation) == ("smollm2:135m", "Q4_1")
    assert stack.engine is not None and stack.engine["manifest_digest"].startswith("9077fe9d")
    assert stack.engine["context_length"] == 8192 and stack.software["backend"] == "ollama 0.5.7"


@pytest.mark.parametrize(
    ("engine", "kind", "model"),
    [("sglang", "sglang", None), ("llamacpp", "llamacpp", None), ("ollama", "ollama", "smollm2:135m")],
    indirect=["engine"],
)
async def test_a_running_engine_is_asked_over_http_and_a_restart_with_other_settings_is_another_stack(
    engine: EngineDocuments, kind: str, model: str | None
) -> None:
    target = Target(engine.url, 5.0, model=model)
    async with aiohttp.ClientSession() as session:
        first = await kind_named(kind).describe(session, target)
        assert first.honest and first.document == first.stack.document()
        assert first.document["engine"]["unreported"], "what it cannot report is said"
        changed = copy.deepcopy(engine.documents)
        for document in changed.values():
            if isinstance(document, dict):
                _change_a_setting(document)
        engine.documents = changed
        second = await kind_named(kind).describe(session, target)
    assert second.fingerprint != first.fingerprint
    if kind == "ollama":
        assert ("POST", "/api/show", {"model": model}) in engine.requests


def _change_a_setting(document: dict[str, object]) -> None:
    for key in ("context_length", "total_slots", "quantization_level", "details"):
        if key == "details" and isinstance(document.get(key), dict):
            document[key] = {**document[key], "quantization_level": "Q8_0"}  # type: ignore[dict-item]
        elif isinstance(document.get(key), int):
            document[key] = int(document[key]) * 2  # type: ignore[call-overload]


@pytest.mark.parametrize("engine", ["llamacpp"], indirect=True)
async def test_an_engine_missing_a_document_it_must_give_is_unreachable_not_a_crash(
    engine: EngineDocuments,
) -> None:
    del engine.documents["/props"]
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ReplicaUnavailable, match="/props"):
            await kind_named("llamacpp").describe(session, Target(engine.url, 5.0))
    engine.documents["/props"] = {"total_slots": 1}  # answers, but says no model: no stack
    engine.documents["/v1/models"] = {"data": []}
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ReplicaUnavailable, match="did not describe a stack"):
            await kind_named("llamacpp").describe(session, Target(engine.url, 5.0))


def test_every_kind_says_where_its_stack_comes_from() -> None:
    sources = {name: kind.source for name, kind in KINDS.items()}
    assert sources == {
        "stackpin": StackSource.PROVEN,
        "upstream": StackSource.DECLARED,
        "vllm": StackSource.REPORTED,
        "sglang": StackSource.REPORTED,
        "llamacpp": StackSource.REPORTED,
        "ollama": StackSource.REPORTED,
    }


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"kind": "vllm", "stack": {"model": "m"}}, "reports its own stack"),
        ({"kind": "ollama"}, "name the one it serves with 'model'"),
        ({"kind": "sglang", "model": "m"}, "leave out 'model'"),
        ({"kind": "upstream"}, "declares its stack"),
        ({"kind": "stackpin", "endpoints": ["/v1/chat/completions"]}, "proves its own stack"),
        ({"kind": "triton"}, "unknown replica kind 'triton'; the kinds are stackpin, upstream, vllm"),
    ],
)
def test_each_kind_judges_its_configuration_entry_and_says_what_to_fix(
    entry: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        ReplicaSettings.model_validate({"name": "r", "url": "http://127.0.0.1:1", **entry})


def test_an_entry_without_a_kind_is_what_it_was_before_kinds_were_named() -> None:
    declared = ReplicaSettings.model_validate({"name": "r", "url": "http://h", "stack": {"model": "m"}})
    proven = ReplicaSettings.model_validate({"name": "r", "url": "http://h"})
    assert (declared.kind_name, proven.kind_name) == ("upstream", "stackpin")


@pytest.mark.parametrize("engine", ["llamacpp"], indirect=True)
async def test_a_reporting_replica_is_served_with_its_token_ids_and_logprobs_recorded(
    engine: EngineDocuments, tmp_path: Path
) -> None:
    replicas = [{"name": "cpp", "kind": "llamacpp", "url": engine.url}]
    async with running_proxy([], tmp_path, replicas=replicas) as proxy:
        chat = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Capital of France?"}],
            "max_tokens": 2,
        }
        status, body, headers = await proxy.post("/v1/chat/completions", chat)
        assert status == 200, body
        assert body["stackpin"] == {"token_ids": [504, 3575], "token_logprobs": [-0.1046, -0.5021]}
        forwarded = engine.requests[-1][2]
        assert forwarded["logprobs"] is True, "the kind asks for the sampled tokens' logprobs"
        record = await proxy.proxy.store.get_record(headers["Stackpin-Record"], None)
        assert record is not None
        (entry,) = record.entries
        assert entry.content["stack_source"] == "reported" and not entry.content["stack_declared"]
        _, stacks = await proxy.get("/v1/stacks")
        assert (
            stacks["replicas"][0]["kind"] == "llamacpp" and stacks["stacks"][0]["stack_source"] == "reported"
        )


@pytest.mark.parametrize("engine", ["ollama"], indirect=True)
async def test_an_engine_that_no_longer_knows_its_model_fails_as_a_replica_not_as_the_client(
    engine: EngineDocuments, tmp_path: Path
) -> None:
    replicas = [{"name": "ol", "kind": "ollama", "url": engine.url, "model": "smollm2:135m"}]
    async with running_proxy([], tmp_path, replicas=replicas) as proxy:
        chat = {"model": "smollm2:135m", "messages": [{"role": "user", "content": "hi"}]}
        status, body, _ = await proxy.post("/v1/chat/completions", chat)  # the fixture serves no chat: 404
    assert status == 502 and body["error"]["code"] == "replica_failed"
    assert (
        "ollama no longer serves the model it reported: no /v1/chat/completions here"
        in body["error"]["message"]
    )
