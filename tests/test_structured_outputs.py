"""Structured outputs end to end, on the embedded default (SmolLM2-135M-Instruct behind `stackpin serve`): the
official OpenAI SDK's `chat.completions.parse` with a nested pydantic model gets a validated object, one answer
(tokens and logprob bits) however often it asks and whatever else the server does meanwhile; `json_object` always
parses; a schema keyword the backend cannot honour is a 400 naming it, through the proxy; the proxy records a
constrained request like any other and `stackpin replay` reproduces it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.embedded_default import stackpin

pytest.importorskip("torch")

MODEL = "smollm2-135m-instruct"
IN_A_ROW = 2
AMID_LOAD = 5  # 7 in all; identical prompts, so these are prefix-cache hits too
BACKGROUND = 3  # other clients, one of each kind of request
MAX_TOKENS = 120


class Kind(StrEnum):
    cat = "cat"
    dog = "dog"
    bird = "bird"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Kind
    age: int | None  # optional: a number or null


class Person(BaseModel):
    name: str = Field(max_length=20)
    pets: list[Pet] = Field(max_length=2)
    nickname: str | None


ASK = [
    {"role": "system", "content": "You answer with JSON only."},
    {"role": "user", "content": "Describe Ada, who has a cat called Tom."},
]
OTHER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string", "maxLength": 40}},
    "required": ["answer", "why"],
    "additionalProperties": False,
}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def parse_person(url: str) -> tuple[Person, dict[str, Any], str]:
    """The parsed object, what identifies the answer (content, token ids, logprob bits), and the record id."""
    raw = client(url).chat.completions.with_raw_response.parse(
        model=MODEL, messages=ASK, response_format=Person, temperature=0, max_tokens=MAX_TOKENS, logprobs=True
    )
    parsed = raw.parse().choices[0].message.parsed
    assert isinstance(parsed, Person)
    body = json.loads(raw.http_response.text)
    choice = body["choices"][0]
    answer = {
        "content": choice["message"]["content"],
        "finish_reason": choice["finish_reason"],
        "logprobs": [float.hex(t["logprob"]) for t in choice["logprobs"]["content"]],
        "tokens": [t["token"] for t in choice["logprobs"]["content"]],
    }
    return parsed, answer, raw.headers["Stackpin-Record"]


def load(url: str, i: int) -> str:
    """Another client's request: another schema, any JSON object, or free text."""
    kind = i % 3
    fields: dict[str, Any] = {}
    if kind == 0:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": OTHER_SCHEMA, "strict": True},
        }
    elif kind == 1:
        fields["response_format"] = {"type": "json_object"}
    completion = client(url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Is {i} an even number? Say why."}],
        max_tokens=12 + 4 * i,
        temperature=0.8,
        seed=i,
        **fields,
    )
    return completion.choices[0].message.content or ""


def test_the_sdk_s_parse_gets_one_validated_answer_in_a_row_and_amid_load(
    embedded_default: tuple[str, Path, dict[str, str]],
) -> None:
    url, _, _ = embedded_default
    answers = [parse_person(url) for _ in range(IN_A_ROW)]
    with ThreadPoolExecutor(max_workers=AMID_LOAD + BACKGROUND) as pool:
        background = [pool.submit(load, url, i) for i in range(BACKGROUND)]
        crowded = [pool.submit(parse_person, url) for _ in range(AMID_LOAD)]
        answers += [future.result() for future in crowded]
        for future in background:
            future.result()
    first_parsed, first_answer, _ = answers[0]
    assert first_answer["finish_reason"] == "stop"
    jsonschema.validate(json.loads(first_answer["content"]), Person.model_json_schema())
    assert first_parsed.pets, "a real model fills in what it was told"
    distinct = {json.dumps(answer, sort_keys=True) for _, answer, _ in answers}
    assert len(answers) == IN_A_ROW + AMID_LOAD
    assert len(distinct) == 1, "batch_invariant mode: one answer, tokens and logprob bits, alone or amid load"


def test_json_object_always_parses(embedded_default: tuple[str, Path, dict[str, str]]) -> None:
    url, _, _ = embedded_default
    questions = ["Give me a recipe.", "What is the weather like on Mars?", "List three colours.", "Hello!"]
    with ThreadPoolExecutor(max_workers=len(questions)) as pool:
        completions = list(
            pool.map(
                lambda q: client(url).chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": q}],
                    response_format={"type": "json_object"},
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                ),
                questions,
            )
        )
    for completion in completions:
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", "the answers end where their object does"
        assert isinstance(json.loads(choice.message.content or ""), dict)


def test_a_constrained_stream_assembles_into_a_valid_answer(
    embedded_default: tuple[str, Path, dict[str, str]],
) -> None:
    url, _, _ = embedded_default
    chunks = list(
        client(url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is ice cold?"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": OTHER_SCHEMA, "strict": True},
            },
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(content), OTHER_SCHEMA)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_keyword_the_backend_cannot_honour_is_a_400_naming_it_through_the_proxy(
    embedded_default: tuple[str, Path, dict[str, str]],
) -> None:
    url, _, _ = embedded_default
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client(url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tags?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert "uniqueItems" in error["message"]
    assert error["param"] == "response_format.json_schema.schema"


def test_a_constrained_request_is_recorded_and_replays_reproduced(
    embedded_default: tuple[str, Path, dict[str, str]],
) -> None:
    url, folder, env = embedded_default
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": OTHER_SCHEMA, "strict": True},
    }
    raw = client(url).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sea salty?"}],
        response_format=response_format,  # type: ignore[arg-type]
        max_tokens=60,
        temperature=0.7,
        seed=7,
    )
    record_id = raw.headers["Stackpin-Record"]
    jsonschema.validate(json.loads(raw.parse().choices[0].message.content or ""), OTHER_SCHEMA)
    record = httpx.get(f"{url}/v1/records/{record_id}").json()
    assert response_format in _values(record), "the record holds the format the request asked for"
    replay = stackpin(folder, env, "replay", record_id, "--url", url, "--json")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert json.loads(replay.stdout)["outcome"] == "reproduced"
    stacks = httpx.get(f"{url}/v1/stacks").text
    assert '"llguidance"' in stacks, "the stack names the grammar engine that constrained the answer"


def _values(document: Any) -> list[Any]:
    """Every object and value nested in `document`."""
    found = [document]
    children = (
        document.values() if isinstance(document, dict) else document if isinstance(document, list) else []
    )
    for child in children:
        found += _values(child)
    return found
