"""The generic tool format: how tools and calls are written in a prompt's text and in a model's answer, for a chat
template that does not render tools itself.

It is the format of Hermes-style models and of Qwen's own template (docs/tools.md): a system block that lists each
function as a JSON object inside `<tools></tools>` and asks for calls as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, separated by a newline; a function's result comes back to the model as a user turn holding
`<tool_response>\\n...\\n</tool_response>`. An answer is read in exactly this spelling (tool_calls.py), and the
grammar that constrains it writes this spelling (tool_grammar.py), so the three never disagree: the spacing inside
the JSON is JSON's default (`", "`, `": "`), which the grammar imposes on the arguments too.

Pure text; this module knows nothing of tokens, templates or requests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
SEPARATOR = "\n"  # between one call's CLOSE and the next call's OPEN


def head(name: str) -> str:
    """What follows OPEN up to the arguments' first character."""
    return f'\n{{"name": {json.dumps(name)}, "arguments": '


HEAD_START = '\n{"name": "'  # head(name) up to the name
AFTER_NAME = '", "arguments": '  # head(name) after the name
AFTER_ARGUMENTS = "}\n"  # after the arguments' last character, before CLOSE
TAIL = AFTER_ARGUMENTS + CLOSE


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it; `arguments` is JSON text (kept as written if it is not JSON)."""
    return OPEN + head(name) + normal_arguments(arguments) + TAIL


def normal_arguments(arguments: str) -> str:
    """The arguments as the grammar spells JSON; text that is not JSON becomes a JSON string of itself."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return json.dumps(arguments, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def tools_block(functions: Sequence[Mapping[str, Any]]) -> str:
    """The system prompt's part that offers `functions` (each OpenAI's `{"name", "description", "parameters"}`)."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        f"{CLOSE}"
    )


def response_text(content: str) -> str:
    """A function's result as the model reads it."""
    return f"<tool_response>\n{content}\n</tool_response>"
