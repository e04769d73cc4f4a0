"""The grammar an answer with tools is generated under, in llguidance's Lark form, as a `Constraint` the server
serves like any other (structured.py).

A call is the generic format's spelling (tool_format.py) with the arguments constrained by the function's own
parameters schema, inlined as `%json` with the layout every JSON value has here (grammar.JSON_OPTIONS: JSON's
default separators, no other whitespace, which a small model could otherwise add forever): the name is one of the
callable functions', the arguments a JSON object valid against that function's schema. Then:

- a forced choice (`required`, or a named function) is one call, or with `parallel_tool_calls` one or more, and
  nothing else;
- `auto` is free text, or free text up to the opening tag and then calls: the text before the tag is a lazy
  lexeme that ends at the first `<tool_call>`, so from the tag on a call is constrained as a forced one is. With a
  `response_format` too, the text is the JSON value that format asks for, or calls;
- `none` is no tool grammar at all: a `response_format` or `guided_*` field applies as without tools.

After the last call only the end of the sequence is allowed. A `guided_*` field beside callable tools is a 400 (one
grammar per answer); a `response_format` beside a forced choice asks nothing of an answer that is only calls. A
parameters schema that llguidance cannot compile is a 400 naming that function's `parameters`, with its reason.

Pure functions of the request and its ToolPlan; compiling and attaching the grammar is grammar.py's and the
engine's business.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llguidance import LLMatcher

from pinned_backend.grammar import JSON_OPTIONS, lark_grammar
from pinned_backend.protocol import BadRequest, ChatRequest
from pinned_backend.structured import ANY_OBJECT, GUIDED, Constraint, requested_constraint
from pinned_backend.tokenizer import Tokenizer
from pinned_backend.tool_format import AFTER_ARGUMENTS, CLOSE, OPEN, SEPARATOR, head
from pinned_backend.tools import AUTO, Function, ToolPlan, key_ordered

# A keyword llguidance does not implement is an error, never a constraint quietly dropped.
_LAYOUT = {**JSON_OPTIONS, "lenient": False}


def tag_tokens(tokenizer: Tokenizer) -> bool:
    """Whether the vocabulary has the tags as tokens of their own (Qwen's does), which the grammar must allow: the
    grammar engine never spells an added token out of text."""
    return all(tokenizer.is_added_token(tag) for tag in (OPEN, CLOSE))


def answer_constraint(
    request: ChatRequest, plan: ToolPlan | None, tag_tokens: bool = False
) -> Constraint | None:
    """The grammar the answer follows: the tools', the request's own format's, or none. `tag_tokens`: the
    vocabulary has `<tool_call>` and `</tool_call>` as tokens of their own (Qwen's)."""
    if plan is None or not plan.callable:
        return requested_constraint(request)
    param = "functions" if plan.legacy else "tools"
    guided = next((key for key in GUIDED if getattr(request, key) is not None), None)
    if guided is not None:
        raise BadRequest(
            f"{guided}: an answer that may call {param} follows their grammar; send {guided} without {param}, or "
            f"set {'function_call' if plan.legacy else 'tool_choice'} to 'none'",
            param=guided,
        )
    for function in plan.callable:
        _check(function.parameters, f"{function.param}.parameters")
    text = _text_schema(request) if plan.choice == AUTO else None
    if (
        text is not None
        and request.response_format is not None
        and request.response_format.type == "json_schema"
    ):
        _check(text, "response_format.json_schema.schema")
    return Constraint(lark_grammar(tool_lark(plan, text, tag_tokens)), param)


def tool_lark(plan: ToolPlan, text_schema: Mapping[str, Any] | None = None, tag_tokens: bool = False) -> str:
    """The Lark grammar of the plan's answer (which must have callable functions); `text_schema`, under `auto`,
    is what the answer must be when it is not calls; `tag_tokens`, whether the tags are tokens of their own."""
    functions = plan.callable
    more = f"({_literal(SEPARATOR)} open body)*" if plan.parallel else ""
    lines = ["%llguidance {}"]
    if plan.choice == AUTO and text_schema is not None:
        lines += [f"start: text | open body {more}", f"text: %json {json.dumps(_laid_out(text_schema))}"]
    elif plan.choice == AUTO:
        lines += [
            f"start: TEXT | opening body {more}",
            "TEXT: /(.|\\n)*/",
            f"opening_text[lazy]: /(.|\\n)*{OPEN}/",
        ]
        # A tag that is a token of its own cannot end a lexeme of text: it follows the text as a token.
        lines += [f"opening: opening_text{f' | TEXT {OPEN}' if tag_tokens else ''}"]
    else:
        lines += [f"start: open body {more}"]
    # A vocabulary with the tags as tokens may still spell them out in pieces; either way is the tag.
    lines += [f"open: {_literal(OPEN)}{f' | {OPEN}' if tag_tokens else ''}"]
    lines += [f"close: {_literal(CLOSE)}{f' | {CLOSE}' if tag_tokens else ''}"]
    lines.append("body: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    lines += [f"call_{i}: {_call(f)}" for i, f in enumerate(functions)]
    return "\n".join(lines) + "\n"


def _check(schema: Mapping[str, Any], param: str) -> None:
    """A 400 naming `param` when llguidance cannot compile the schema, with its reason."""
    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(json.dumps(_laid_out(schema))))
    if error:
        raise BadRequest(
            f"{param}: {error}; this backend cannot constrain its output to that, so it refuses rather than "
            "answer unconstrained",
            param=param,
        )


def _text_schema(request: ChatRequest) -> Mapping[str, Any] | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ANY_OBJECT
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        param = "response_format.json_schema.schema"
        raise BadRequest(f"{param}: a json_schema response format needs the JSON schema", param=param)
    return key_ordered(fmt.json_schema.schema_, "response_format.json_schema.schema")


def _call(function: Function) -> str:
    schema = json.dumps(_laid_out(function.parameters))
    return f"{_literal(head(function.name))} %json {schema} {_literal(AFTER_ARGUMENTS)} close"


def _laid_out(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": _LAYOUT}


def _literal(text: str) -> str:
    # A Lark string literal takes JSON's escapes.
    return json.dumps(text)
