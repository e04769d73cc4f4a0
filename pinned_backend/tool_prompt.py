"""A chat request's messages as its model's chat template receives them, tools and tool turns included.

Where the template renders tools itself in the generic format's spelling (it reads a `tools` variable and writes
`<tool_call>`, as Qwen's and Hermes-style templates do: `renders_tools`), it gets them as Hugging Face's templates
expect: `tools` as OpenAI's list of `{"type": "function", "function": {...}}`, an assistant's
calls as `tool_calls` whose `arguments` are the parsed JSON object (as written, if not JSON), and results as `tool`
messages; a legacy `function` message becomes a `tool` message and a legacy `function_call` one call. Where it
does not (SmolLM2's), the messages are rewritten in the generic format (tool_format.py): the tools block joins the
system message (or becomes one), calls are written into the assistant's text, and each run of results becomes one
user message of `<tool_response>` blocks. Calls and results in the conversation are rendered whether or not the
request offers tools; the tools are listed only where the answer may call one (`tool_choice` other than `none`).

Pure functions of the request; the template itself is rendered by tokenizer.py.
"""

from __future__ import annotations

import json
from typing import Any

from pinned_backend.protocol import FunctionCall, Message
from pinned_backend.tool_format import OPEN, call_text, response_text, tools_block
from pinned_backend.tools import ToolPlan


def renders_tools(template: str | None, takes_tools: bool) -> bool:
    """Whether a chat template (its source, and whether it reads `tools`) renders tools and calls itself, in the
    spelling the answer is constrained to."""
    return takes_tools and template is not None and OPEN in template


def chat_prompt(
    messages: list[Message], plan: ToolPlan | None, own_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages for the template, and the extra variables it is rendered with; `own_tools`: the template
    renders tools itself (`renders_tools`)."""
    offered = [f.definition() for f in plan.functions] if plan is not None and plan.callable else []
    if own_tools:
        extra = {"tools": [{"type": "function", "function": f} for f in offered]} if offered else {}
        return [_template_message(m) for m in messages], extra
    rendered = _generic_messages(messages)
    if offered:
        block = tools_block(offered)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{block}"}
        else:
            rendered.insert(0, {"role": "system", "content": block})
    return rendered, {}


def _calls(message: Message) -> list[tuple[str, FunctionCall]]:
    """An assistant message's calls as (id, call), the legacy `function_call` included."""
    calls = [(c.id, c.function) for c in message.tool_calls or []]
    if message.function_call is not None:
        calls.append(("", message.function_call))
    return calls


def _template_message(message: Message) -> dict[str, Any]:
    role = "tool" if message.role == "function" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    calls = _calls(message)
    if calls:
        out["tool_calls"] = [
            {"id": id_, "type": "function", "function": {"name": f.name, "arguments": _parsed(f.arguments)}}
            for id_, f in calls
        ]
    return out


def _parsed(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _generic_messages(messages: list[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    results_open = False  # the last message is a user turn of results that the next result joins
    for message in messages:
        if message.role in ("tool", "function"):
            block = response_text(message.text())
            if results_open:
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
            results_open = True
            continue
        results_open = False
        calls = [call_text(f.name, f.arguments) for _, f in _calls(message)]
        text = "\n".join([message.text()] * bool(message.text()) + calls)
        out.append({"role": message.role, "content": text})
    return out
