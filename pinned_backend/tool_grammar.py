"""The grammar an answer with tools is generated under, in llguidance's Lark form.

A call is the generic format's spelling (tool_format.py) with the arguments constrained by the function's own
parameters schema, inlined as `%json`: the name is one of the callable functions', the arguments a JSON object that
validates against that function's schema, written with JSON's default separators and no other whitespace (a small
model left free to add whitespace can add it forever). Then:

- a forced choice (`required`, or a named function) is one call, or with `parallel_tool_calls` one or more, and
  nothing else;
- `auto` is free text, or free text up to the opening tag and then calls: the text before the tag is a lazy
  lexeme that ends at the first `<tool_call>`, so from the tag on the call is constrained exactly as a forced one;
- `none` is no grammar at all.

After the last call only the end of the sequence is allowed. A schema that llguidance cannot compile (a keyword it
does not support, a malformed schema) is a 400 naming the function's `parameters`, with llguidance's reason.

Pure functions of a ToolPlan; attaching the grammar to a sequence is the engine's business.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llguidance import LLMatcher

from pinned_backend.protocol import BadRequest
from pinned_backend.tool_format import OPEN, SEPARATOR, TAIL, head
from pinned_backend.tools import AUTO, Function, ToolPlan

# llguidance's JSON options: the separators JSON's default writes, and no free whitespace.
_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_grammar(plan: ToolPlan) -> str | None:
    """The Lark grammar for the plan's answer; None when the answer is free text (`none`)."""
    functions = plan.callable
    if not functions:
        return None
    lines = ["%llguidance {}"]
    more = f"({_literal(SEPARATOR + OPEN)} body)*" if plan.parallel else ""
    if plan.choice == AUTO:
        lines += [
            f"start: TEXT | opening body {more}",
            "TEXT: /(.|\\n)*/",
            f"opening[lazy]: /(.|\\n)*{OPEN}/",
        ]
    else:
        lines += [f"start: {_literal(OPEN)} body {more}"]
    lines.append("body: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    lines += [f"call_{i}: {_call(f)}" for i, f in enumerate(functions)]
    return "\n".join(lines) + "\n"


def arguments_schema(function: Function) -> dict[str, Any]:
    """The function's parameters schema, with the spacing the grammar imposes."""
    schema = dict(function.parameters)
    return {**schema, "x-guidance": {**_SPACING, **_mapping(schema.get("x-guidance"))}}


def check_schemas(plan: ToolPlan) -> None:
    """A 400 naming the first callable function whose parameters llguidance cannot compile."""
    for function in plan.callable:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(arguments_schema(function)))
        error = LLMatcher.validate_grammar(grammar)
        if error:
            param = f"{function.param}.parameters"
            raise BadRequest(f"{param}: this schema cannot constrain the arguments: {error}", param=param)


def _call(function: Function) -> str:
    return f"{_literal(head(function.name))} %json {json.dumps(arguments_schema(function))} {_literal(TAIL)}"


def _literal(text: str) -> str:
    # A Lark string literal takes JSON's escapes.
    return json.dumps(text)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
