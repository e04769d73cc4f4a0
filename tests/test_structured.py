"""Specification of pinned_backend.structured: which request field asks for which grammar, and the 400s for asking
twice or sending no schema."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pinned_backend.grammar import choice_grammar, json_schema_grammar, lark_grammar, regex_grammar
from pinned_backend.protocol import BadRequest, ChatRequest, CompletionRequest, parse_request
from pinned_backend.structured import Constraint, requested_constraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
HELLO = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatRequest:
    return parse_request(ChatRequest, {"messages": HELLO, **fields})


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_object"}},
            Constraint(json_schema_grammar({"type": "object"}), "response_format"),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
            Constraint(json_schema_grammar(SCHEMA), "response_format.json_schema.schema"),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": False},
                }
            },
            Constraint(json_schema_grammar(SCHEMA), "response_format.json_schema.schema"),
        ),
        ({"guided_json": SCHEMA}, Constraint(json_schema_grammar(SCHEMA), "guided_json")),
        ({"guided_json": json.dumps(SCHEMA)}, Constraint(json_schema_grammar(SCHEMA), "guided_json")),
        ({"guided_regex": "[0-9]+"}, Constraint(regex_grammar("[0-9]+"), "guided_regex")),
        ({"guided_choice": ["yes", "no"]}, Constraint(choice_grammar(["yes", "no"]), "guided_choice")),
        ({"guided_grammar": 'start: "x"'}, Constraint(lark_grammar('start: "x"'), "guided_grammar")),
    ],
)
def test_each_field_asks_for_its_grammar(fields: dict[str, Any], expected: Constraint | None) -> None:
    assert requested_constraint(chat(**fields)) == expected


def test_completions_take_the_same_fields() -> None:
    body = parse_request(CompletionRequest, {"prompt": "x", "guided_regex": "a|b"})
    assert requested_constraint(body) == Constraint(regex_grammar("a|b"), "guided_regex")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "only one"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "only one"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            "response_format.json_schema.schema",
            "needs the JSON schema",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json", "must be a JSON object"),
    ],
)
def test_asking_twice_or_without_a_schema_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(BadRequest) as caught:
        requested_constraint(chat(**fields))
    assert caught.value.param == param
    assert words in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": 5}, "guided_regex"),
    ],
)
def test_malformed_fields_are_refused_when_parsed(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        chat(**fields)
    assert caught.value.param is not None and caught.value.param.startswith(param)
