"""What a chat request asks of tools: the functions it offers the model, whether its answer may or must call one
and which, how many calls it may hold, and in which shape they go back (`tool_calls`, or the legacy
`function_call`).

`tool_plan` reads a validated request (protocol.py) and refuses with a 400 naming the field what contradicts itself:
`tools` and `functions` together, a choice naming a function that is not offered, `required` with nothing offered,
two functions of one name, parameters that are not the schema of a JSON object. OpenAI's defaults hold: with
functions offered the choice is `auto`, without them `none`; an omitted `parameters` means no arguments (`{}`); a
named function is called once, whatever `parallel_tool_calls` says. A function's parameters are kept with their
keys in RFC 8785's order, as a record keeps them, so that a replay renders and constrains exactly as the original.

This module knows nothing of prompts, grammars or the model's output: tool_prompt.py renders the plan's functions,
tool_grammar.py constrains the answer to its choice, tool_calls.py reads the calls back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import rfc8785

from pinned_backend.protocol import BadRequest, ChatRequest, FunctionDefinition

NO_ARGUMENTS: Mapping[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
AUTO, NONE, REQUIRED = "auto", "none", "required"


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: Mapping[str, Any]  # a JSON schema of an object
    param: str  # where the request defined it, e.g. "tools.0.function", for errors

    def definition(self) -> dict[str, Any]:
        """OpenAI's description of the function, as a prompt lists it."""
        described = {"description": self.description} if self.description is not None else {}
        return {"name": self.name, **described, "parameters": dict(self.parameters)}


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[Function, ...]  # offered to the model, in the request's order
    choice: str  # "none", "auto", "required", or the name of the one function the answer must call
    parallel: bool  # may one answer hold several calls
    legacy: bool  # asked with `functions`: the call goes back as `message.function_call`

    @property
    def forced(self) -> bool:
        """The answer is calls and nothing else."""
        return self.choice not in (NONE, AUTO)

    @property
    def callable(self) -> tuple[Function, ...]:
        """The functions an answer may call: none, every one offered, or the one named."""
        if self.choice == NONE:
            return ()
        if self.choice in (AUTO, REQUIRED):
            return self.functions
        return tuple(f for f in self.functions if f.name == self.choice)


def tool_plan(request: ChatRequest) -> ToolPlan | None:
    """The request's tools, or None when it offers none and demands no call."""
    if request.tools and request.functions:
        raise BadRequest(
            "functions: send tools or the legacy functions, not both (tools is the current form)",
            param="functions",
        )
    if request.functions:
        functions = _functions([(f, f"functions.{i}") for i, f in enumerate(request.functions)])
        choice = _legacy_choice(request)
        return ToolPlan(functions, _checked(choice, functions, "function_call"), False, True)
    functions = _functions([(t.function, f"tools.{i}.function") for i, t in enumerate(request.tools or [])])
    choice = request.tool_choice
    name = choice if isinstance(choice, str) or choice is None else choice.function.name
    if not functions:
        if name not in (None, NONE, AUTO):
            raise BadRequest(
                f"tool_choice: {name!r} asks for a call, but the request offers no tools; send them in tools",
                param="tool_choice",
            )
        return None
    checked = _checked(name or AUTO, functions, "tool_choice")
    # A named function is one call of it, as OpenAI's and vLLM's answer it (clients such as instructor rely on it).
    parallel = request.parallel_tool_calls and checked in (AUTO, REQUIRED)
    return ToolPlan(functions, checked, parallel, False)


def _legacy_choice(request: ChatRequest) -> str:
    choice = request.function_call
    if choice is None:
        return AUTO
    return choice if isinstance(choice, str) else choice.name


def _checked(choice: str, functions: tuple[Function, ...], param: str) -> str:
    if choice in (NONE, AUTO, REQUIRED) or any(f.name == choice for f in functions):
        return choice
    offered = ", ".join(repr(f.name) for f in functions)
    raise BadRequest(
        f"{param}: no function named {choice!r} is offered; the request offers {offered}", param=param
    )


def _functions(defined: list[tuple[FunctionDefinition, str]]) -> tuple[Function, ...]:
    seen: set[str] = set()
    functions = []
    for definition, param in defined:
        if definition.name in seen:
            raise BadRequest(
                f"{param}.name: two functions are named {definition.name!r}; give each its own name",
                param=f"{param}.name",
            )
        seen.add(definition.name)
        parameters = definition.parameters if definition.parameters is not None else NO_ARGUMENTS
        if parameters.get("type", "object") != "object":
            raise BadRequest(
                f"{param}.parameters: a function's arguments are a JSON object, so its parameters must be the "
                f"schema of one (type 'object'), not of type {parameters.get('type')!r}",
                param=f"{param}.parameters",
            )
        functions.append(
            Function(
                definition.name, definition.description, key_ordered(parameters, f"{param}.parameters"), param
            )
        )
    return tuple(functions)


def key_ordered(schema: Mapping[str, Any], param: str) -> dict[str, Any]:
    """The schema with every object's keys in RFC 8785's order, the order a record keeps a request in: the prompt
    that lists it and the grammar built from it (whose arguments list properties in the schema's order) are then the
    same for a replay of the record as for the original request, however the client ordered the keys."""
    try:
        return dict(json.loads(rfc8785.dumps(schema)))
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise BadRequest(f"{param}: not plain JSON ({exc})", param=param) from None
