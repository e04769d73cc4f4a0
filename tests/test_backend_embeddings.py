"""Specification of pinned_backend.embeddings through the server's `/v1/embeddings`: one unit vector per input,
pooled as the stack says, whose bits depend on that input alone: not on the other inputs of its request, nor on
what the engine serves meanwhile, in either kernel mode."""

from __future__ import annotations

import asyncio
import base64
import random
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from pinned_backend.embeddings import pool
from pinned_backend.runtime import BackendSettings
from pinned_backend.server import create_app
from tests.support.backend_checkpoint import CHARACTERS, write_random_checkpoint

EMBEDDINGS = "/v1/embeddings"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("embeddings") / "random-qwen3", with_tokenizer=True
    )


def settings(checkpoint: Path, **overrides: Any) -> BackendSettings:
    # A small step budget, so that long inputs are embedded over several passes.
    fields: dict[str, Any] = {
        "model": checkpoint,
        "block_size": 4,
        "kv_split_size": 8,
        "kv_cache_mb": 1,
        "max_step_tokens": 32,
    }
    return BackendSettings(**{**fields, **overrides})


async def serve(checkpoint: Path, **overrides: Any) -> TestClient:
    return TestClient(TestServer(create_app(settings(checkpoint, **overrides)), host="127.0.0.1"))


@pytest.fixture
async def client(checkpoint: Path) -> AsyncIterator[TestClient]:
    async with await serve(checkpoint) as c:
        yield c


async def embed(client: TestClient, inputs: Any, **extra: Any) -> dict[str, Any]:
    response = await client.post(EMBEDDINGS, json={"input": inputs, **extra})
    body = await response.json()
    assert response.status == 200, body
    return body


def bits(vector: list[float]) -> bytes:
    return struct.pack(f"<{len(vector)}f", *vector)


def text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(CHARACTERS) for _ in range(length))


@pytest.mark.parametrize("kernel_mode", ["batch_invariant", "default"])
async def test_an_inputs_vector_is_bit_identical_alone_and_amid_up_to_16_others_of_random_lengths(
    checkpoint: Path, kernel_mode: str
) -> None:
    rng = random.Random(7)
    probe = text(rng, 45)  # longer than a pass: embedded over two
    async with await serve(checkpoint, kernel_mode=kernel_mode) as client:
        alone = (await embed(client, probe))["data"][0]["embedding"]
        for trial in range(4):
            others = [text(rng, rng.randint(1, 120)) for _ in range(rng.randint(1, 16))]
            at = rng.randint(0, len(others))
            inputs = [*others[:at], probe, *others[at:]]
            # Chat requests decode in the engine meanwhile: the embeddings' passes run between their steps.
            chats = [
                client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": text(rng, 30)}], "max_tokens": 12},
                )
                for _ in range(3)
            ]
            amid, *_ = await asyncio.gather(embed(client, inputs), *chats)
            vector = amid["data"][at]["embedding"]
            assert bits(vector) == bits(alone), (
                f"trial {trial}: the probe's vector changed among {len(others)} other inputs ({kernel_mode})"
            )


async def test_vectors_have_unit_norm_the_hidden_size_and_the_stack_names_the_pooling(
    client: TestClient,
) -> None:
    body = await embed(client, ["Hello there", "a"])
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    stack = (await (await client.get("/v1/stack")).json())["stack"]
    assert stack["embedding"] == {"pooling": "last_token", "normalized": True}
    assert body["stackpin"]["embedding"] == stack["embedding"]
    assert body["system_fingerprint"] == (await (await client.get("/v1/stack")).json())["fingerprint"]
    for item in body["data"]:
        vector = torch.tensor(item["embedding"], dtype=torch.float64)
        assert vector.shape == (64,)
        assert abs(float(vector.norm()) - 1) < 1e-6
    ids = body["stackpin"]["input_token_ids"]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}


async def test_token_ids_base64_and_dimensions_are_honoured(client: TestClient) -> None:
    as_text = await embed(client, "abc")
    ids = as_text["stackpin"]["input_token_ids"][0]
    assert (await embed(client, ids))["data"][0]["embedding"] == as_text["data"][0]["embedding"]
    packed = (await embed(client, [ids], encoding_format="base64"))["data"][0]["embedding"]
    assert base64.b64decode(packed) == bits(as_text["data"][0]["embedding"])
    short = (await embed(client, "abc", dimensions=8))["data"][0]["embedding"]
    assert len(short) == 8 and abs(sum(x * x for x in short) - 1) < 1e-6


async def test_mean_pooling_is_a_stack_of_its_own(checkpoint: Path) -> None:
    async with await serve(checkpoint, pooling="mean") as client:
        stack = (await (await client.get("/v1/stack")).json())["stack"]
        assert stack["embedding"]["pooling"] == "mean"
        probe = "the mean of every token"
        alone = (await embed(client, probe))["data"][0]["embedding"]
        amid = (await embed(client, ["x" * 70, probe, "yz"]))["data"][1]["embedding"]
        assert bits(alone) == bits(amid)


def test_pooling_sums_in_token_order_and_normalises() -> None:
    hidden = torch.tensor([[3.0, 0.0], [0.0, 4.0], [3.0, 4.0]])
    assert pool(hidden, "last_token", None).tolist() == pytest.approx([0.6, 0.8])
    assert pool(hidden, "mean", None).tolist() == pytest.approx([0.6, 0.8])
    assert pool(hidden, "mean", 1).tolist() == [1.0]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({}, "input", "required"),
        ({"input": []}, "input", "at least 1"),
        ({"input": ""}, "input", "no tokens"),
        ({"input": [1, 9999]}, "input", "token ids"),
        ({"input": "a" * 300}, "input", "context"),
        ({"input": "a", "dimensions": 65}, "dimensions", "at most"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float"),
    ],
)
async def test_bad_embedding_requests_get_a_400_naming_the_field(
    client: TestClient, body: dict[str, Any], param: str, words: str
) -> None:
    response = await client.post(EMBEDDINGS, json=body)
    error = (await response.json())["error"]
    assert response.status == 400, error
    assert error["param"] == param and words in error["message"]


async def test_the_openai_sdk_embeds_through_it(client: TestClient) -> None:
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    try:
        # The SDK asks for base64 unless told otherwise, and decodes it to floats.
        result = await sdk.embeddings.create(model="random-qwen3", input=["one", "two"])
        direct = await embed(client, ["one", "two"])
        assert [d.embedding for d in result.data] == [d["embedding"] for d in direct["data"]]
        assert (await sdk.models.retrieve("random-qwen3")).id == "random-qwen3"
        with pytest.raises(openai.NotFoundError):
            await sdk.models.retrieve("another-model")
    finally:
        await sdk.close()
