"""The Responses API over chat: a `POST /v1/responses` request as a chat request, and a chat answer (whole or
streamed) as the response, with OpenAI's event names, for replicas that serve chat only (a pinned_backend).

What translates: instructions (a first system message), text input and multi-turn input items (messages with
text parts, function calls and their outputs), function tools and tool choice, `max_output_tokens`, sampling
settings, logprobs, and text formats (`text.format`, which the replica honours or refuses). What cannot is refused
with a 400 naming the field (images, files, built-in tools, reasoning, background runs, stored prompts): an
answer without what was asked for would pretend. A replica's refusal of the chat request it was sent names the
client's own field (`responses_error`): `text.format`, never the `response_format` the client did not send. A response's id is its record's (`resp_<hex>` for `rec_<hex>`),
so `previous_response_id` leads back to the record, whose fully expanded input the next request continues
(`expand`). Pure functions; the stream translator keeps its own state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from proxy.endpoints import CHAT
from proxy.errors import BadRequest
from proxy.evidence.answers import ChunkAssembly

_RECORD = re.compile(r"^rec_(?P<hex>[0-9a-f]{32})$")
_RESPONSE = re.compile(r"^resp_(?P<hex>[0-9a-f]{32})$")
# What changes no answer and has no chat equivalent (`text` and `include` are read for what they ask of one).
_DROPPED = ("metadata", "store", "include", "prompt_cache_key", "safety_identifier", "service_tier", "text")
_REFUSED = {
    "background": "background runs are not served here; leave 'background' out",
    "conversation": "conversations are not kept here; send previous_response_id or the whole input",
    "prompt": "stored prompts are not kept here; send the text (or pin a prompt version)",
    "reasoning": "this replica has no reasoning mode",
    "max_tool_calls": "this replica cannot bound its tool calls",
}


# A chat field the translation writes, and the Responses field it comes from (`N` a tool's index).
_CHAT_FIELDS = (
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^max_(completion_)?tokens"), "max_output_tokens"),
    (re.compile(r"^tools\.(?P<n>\d+)\.function"), r"tools[\g<n>]"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
    (re.compile(r"^messages(\..*)?$"), "input"),  # the messages' order is not the input's
)


def responses_error(body: dict[str, Any]) -> dict[str, Any]:
    """A replica's error about the chat request it was sent, in terms of the Responses request it came from: the
    `param`, and the message wherever it names the param, name the client's field."""
    error = body.get("error")
    param = error.get("param") if isinstance(error, dict) else None
    if not isinstance(error, dict) or not isinstance(param, str):
        return body
    renamed = param
    for chat_field, field_name in _CHAT_FIELDS:
        renamed, count = chat_field.subn(field_name, renamed, count=1)
        if count:
            break
    message = error.get("message")
    if isinstance(message, str):
        message = message.replace(param, renamed)
    return {**body, "error": {**error, "param": renamed, "message": message}}


def response_id(record_id: str) -> str:
    match = _RECORD.match(record_id)
    return f"resp_{match['hex']}" if match else f"resp_{record_id}"


def record_of(previous_response_id: str) -> str:
    match = _RESPONSE.match(previous_response_id)
    if match is None:
        raise BadRequest(
            f"previous_response_id {previous_response_id!r} is no response of this proxy (they look like resp_<32 hex>)",
            param="previous_response_id",
        )
    return f"rec_{match['hex']}"


def input_items(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


def expand(
    body: dict[str, Any], previous_request: dict[str, Any], previous_response: dict[str, Any]
) -> dict[str, Any]:
    """The request with `previous_response_id` replaced by what it stands for: the previous request's input, the
    previous response's output, then this request's input. Instructions are not carried over, as OpenAI's."""
    output = previous_response.get("output") if isinstance(previous_response.get("output"), list) else []
    items = [*input_items(previous_request.get("input")), *output, *input_items(body.get("input"))]
    return {**{k: v for k, v in body.items() if k != "previous_response_id"}, "input": items}


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses request means; a 400 naming the field that has no chat equivalent."""
    for key, why in _REFUSED.items():
        if body.get(key) not in (None, False, {}, []):
            raise BadRequest(f"{key}: {why}", param=key)
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequest("truncation: this replica never drops input; leave it out", param="truncation")
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    for i, item in enumerate(input_items(body.get("input"))):
        _add_item(messages, item, f"input[{i}]")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    # The sampling settings (temperature, top_p, stream, ...) and vendor extensions (top_k, seed) are chat's too.
    translated = {
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "top_logprobs",
        "truncation",
    }
    chat.update(
        {k: v for k, v in body.items() if k not in translated | set(_DROPPED) | set(_REFUSED) | set(chat)}
    )
    if body.get("tools"):
        chat["tools"] = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        chat["response_format"] = (
            {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
            if fmt.get("type") == "json_schema"
            else {"type": fmt["type"]}
        )
    if body.get("top_logprobs") is not None or "message.output_text.logprobs" in (body.get("include") or []):
        chat["logprobs"] = True
        if body.get("top_logprobs"):
            chat["top_logprobs"] = body["top_logprobs"]
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return chat


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        messages.append({"role": item.get("role"), "content": _text_of(item.get("content"), where)})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append(
            {"role": "tool", "tool_call_id": item.get("call_id"), "content": _text_of(output, where)}
        )
    else:
        raise BadRequest(f"{where}: input items of type {kind!r} have no chat equivalent here", param=where)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(
            f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise BadRequest(
                f"{where}.content[{j}]: parts of type {kind!r} cannot be served here (text only)",
                param=f"{where}.content[{j}]",
            )
    return "".join(texts)


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise BadRequest(f"{where}: tools of type {kind!r} have no chat equivalent here", param=where)
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


@dataclass(frozen=True)
class Echo:
    """What a response repeats of its request, and the handles it is known by."""

    id: str
    created_at: int
    request: dict[str, Any]
    previous_response_id: str | None

    def skeleton(self, model: Any, status: str) -> dict[str, Any]:
        r = self.request
        text = r.get("text") if isinstance(r.get("text"), dict) else {"format": {"type": "text"}}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": r.get("instructions"),
            "max_output_tokens": r.get("max_output_tokens"),
            "model": model,
            "output": [],
            "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "previous_response_id": self.previous_response_id,
            "temperature": r.get("temperature"),
            "text": text,
            "tool_choice": r.get("tool_choice", "auto"),
            "tools": r.get("tools") or [],
            "top_p": r.get("top_p"),
            "truncation": "disabled",
            "usage": None,
            "metadata": r.get("metadata") or {},
        }


def from_chat(chat: dict[str, Any], echo: Echo) -> dict[str, Any]:
    """The response a chat answer (choice 0) means."""
    choice = next((c for c in chat.get("choices") or [] if isinstance(c, dict)), {})
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    finish = choice.get("finish_reason")
    incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(finish or "")
    status = "incomplete" if incomplete else "completed"
    response = echo.skeleton(chat.get("model"), status)
    hex_id = echo.id.removeprefix("resp_")
    output: list[dict[str, Any]] = []
    text, refusal = message.get("content"), message.get("refusal")
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    if text or refusal or not calls:
        output.append(_message_item(hex_id, text, refusal, choice.get("logprobs"), status))
    output.extend(_call_item(hex_id, i, call) for i, call in enumerate(calls))
    response["output"] = output
    response["incomplete_details"] = {"reason": incomplete} if incomplete else None
    response["usage"] = _usage(chat.get("usage"))
    return response


def _message_item(hex_id: str, text: Any, refusal: Any, logprobs: Any, status: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if isinstance(refusal, str) and refusal:
        content.append({"type": "refusal", "refusal": refusal})
    if isinstance(text, str) and (text or not content):
        content.append(
            {"type": "output_text", "text": text, "annotations": [], "logprobs": _logprobs(logprobs)}
        )
    return {
        "id": f"msg_{hex_id}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _call_item(hex_id: str, i: int, call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    return {
        "id": f"fc_{hex_id}_{i}",
        "type": "function_call",
        "status": "completed",
        "call_id": call.get("id") or f"call_{hex_id}_{i}",
        "name": function.get("name"),
        "arguments": function.get("arguments") or "",
    }


def _logprobs(logprobs: Any) -> list[dict[str, Any]]:
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return [dict(entry) for entry in content if isinstance(entry, dict)] if isinstance(content, list) else []


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", prompt + completion),
    }


@dataclass
class ResponsesStream:
    """Turns a chat stream into the Responses API's events, in OpenAI's order and names: the response created
    and in progress, each output item added, its deltas, each item done, the response completed (or incomplete)."""

    echo: Echo
    chat: ChunkAssembly = field(default_factory=lambda: ChunkAssembly(CHAT))
    sequence: int = 0
    started: bool = False
    text_open: bool = False
    items: list[dict[str, Any]] = field(default_factory=list)  # output items added so far, in output order
    calls: dict[int, int] = field(default_factory=dict)  # tool call index -> output index

    def feed(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self.chat.add(chunk)
        events: list[tuple[str, dict[str, Any]]] = []
        if not self.started:
            self.started = True
            skeleton = self.echo.skeleton(chunk.get("model"), "in_progress")
            events += [self._event("response.created", response=skeleton)]
            events += [self._event("response.in_progress", response=skeleton)]
        for choice in chunk.get("choices") or []:
            if (
                isinstance(choice, dict)
                and choice.get("index", 0) == 0
                and isinstance(choice.get("delta"), dict)
            ):
                events += self._delta(choice["delta"], choice.get("logprobs"))
        return events

    def _delta(self, delta: dict[str, Any], logprobs: Any) -> list[tuple[str, dict[str, Any]]]:
        events = []
        text = delta.get("content")
        if isinstance(text, str) and text:
            if not self.text_open:
                events += self._open_message()
            item = self.items[0]
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=0,
                                      content_index=0, delta=text, logprobs=_logprobs(logprobs)))  # fmt: skip
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            index = call.get("index", 0)
            if index not in self.calls:
                events += self._close_message()
                function = call.get("function") or {}
                item = _call_item(self.echo.id.removeprefix("resp_"), len(self.calls), {**call, "function": {
                    "name": function.get("name"), "arguments": ""}})  # fmt: skip
                item["status"] = "in_progress"
                self.calls[index] = len(self.items)
                self.items.append(item)
                events.append(
                    self._event("response.output_item.added", output_index=self.calls[index], item=item)
                )
            arguments = (call.get("function") or {}).get("arguments")
            if isinstance(arguments, str) and arguments:
                out = self.calls[index]
                events.append(self._event("response.function_call_arguments.delta", item_id=self.items[out]["id"],
                                          output_index=out, delta=arguments))  # fmt: skip
        return events

    def _open_message(self) -> list[tuple[str, dict[str, Any]]]:
        self.text_open = True
        item = {"id": f"msg_{self.echo.id.removeprefix('resp_')}", "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        self.items.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event(
                "response.content_part.added", item_id=item["id"], output_index=0, content_index=0, part=part
            ),
        ]

    def _close_message(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.text_open:
            return []
        self.text_open = False
        final = self._final()
        done = next(item for item in final["output"] if item["type"] == "message")
        part = done["content"][-1]
        return [
            self._event("response.output_text.done", item_id=done["id"], output_index=0, content_index=0,
                        text=part.get("text", ""), logprobs=part.get("logprobs", [])),
            self._event("response.content_part.done", item_id=done["id"], output_index=0, content_index=0, part=part),
            self._event("response.output_item.done", output_index=0, item=done),
        ]  # fmt: skip

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        """The events after the chat stream's end: every item done, then the response's terminal event."""
        events = []
        final = self._final()
        if not self.items and final["output"]:  # an empty answer still has its (empty) message item
            events += self._open_message()
        events += self._close_message()
        for out in sorted(self.calls.values()):
            done = final["output"][out] if out < len(final["output"]) else self.items[out]
            events.append(self._event("response.function_call_arguments.done", item_id=done["id"], output_index=out,
                                      arguments=done.get("arguments", "")))  # fmt: skip
            events.append(self._event("response.output_item.done", output_index=out, item=done))
        name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append(self._event(name, response=final))
        return events

    def error(self, message: str) -> tuple[str, dict[str, Any]]:
        return self._event("error", code="replica_failed", message=message, param=None)

    def body(self) -> dict[str, Any]:
        """The response as a whole, from what the chat stream said so far."""
        return self._final()

    def _final(self) -> dict[str, Any]:
        return from_chat(self.chat.body(), self.echo)

    def _event(self, name: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        payload = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return name, payload
