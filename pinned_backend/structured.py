"""What a request asks its output to be, as a grammar: OpenAI's `response_format` and vLLM's `guided_*` fields.

`requested_constraint(body)` turns a validated request into a `Constraint` (the grammar, and the request field it
came from, which any error names), or None for free text. At most one such field may ask for something:
`response_format` `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}` (a value valid against the schema, strict or not: the output always follows it),
`guided_json` (a schema, as an object or as JSON text), `guided_regex`, `guided_choice` (one of the strings) and
`guided_grammar` (a Lark or GBNF grammar). Whether the grammar engine can honour the grammar is found when it is
compiled (grammar.py), which raises a `GrammarError` naming the keyword; the server answers both kinds of error
with a 400 whose `param` is `Constraint.param`.

Another source of grammars (tool definitions) builds a `Constraint` of its own; the server serves either the same
way. This module knows nothing of tokenizers or the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pinned_backend.grammar import (
    Grammar,
    GrammarError,
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from pinned_backend.protocol import BadRequest, ChatRequest, CompletionRequest

ANY_OBJECT: dict[str, Any] = {"type": "object"}
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class Constraint:
    grammar: Grammar
    param: str  # the request field that asked for it


def requested_constraint(body: ChatRequest | CompletionRequest) -> Constraint | None:
    """The grammar the request's output must follow, or None; a 400 when it asks in more than one way or sends a
    schema that is not a JSON object."""
    asked = [key for key in GUIDED if getattr(body, key) is not None]
    if body.response_format is not None and body.response_format.type != "text":
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise BadRequest(
            f"{', '.join(asked)}: each asks for an output format; send only one of them", param=asked[1]
        )
    if not asked:
        return None
    param = asked[0]
    if param == "response_format" and body.response_format and body.response_format.type == "json_schema":
        param = "response_format.json_schema.schema"
    try:
        return Constraint(_grammar(body, param), param)
    except ValueError as exc:  # GrammarError, or llguidance refusing the text outright
        raise BadRequest(f"{param}: {exc}", param=param) from None


def _grammar(body: ChatRequest | CompletionRequest, param: str) -> Grammar:
    if param == "response_format":  # json_object
        return json_schema_grammar(ANY_OBJECT)
    if param == "response_format.json_schema.schema":
        spec = body.response_format.json_schema if body.response_format else None
        if spec is None or spec.schema_ is None:
            raise GrammarError("a json_schema response format needs the JSON schema the output must follow")
        return json_schema_grammar(spec.schema_)
    if param == "guided_json":
        return json_schema_grammar(_schema_value(body.guided_json))
    if param == "guided_regex":
        return regex_grammar(body.guided_regex or "")
    if param == "guided_choice":
        return choice_grammar(body.guided_choice or [])
    return lark_grammar(body.guided_grammar or "")


def _schema_value(value: dict[str, Any] | str | None) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise GrammarError("the schema must be a JSON object")
    return value
