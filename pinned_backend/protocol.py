"""The OpenAI requests the backend accepts, validated, and the errors it answers with.

Requests are pydantic models that ignore unknown fields and refuse known fields of the wrong type;
`parse_request` turns a validation failure into an `ApiError` naming the field and what to send instead. A field
of OpenAI's API that would change the answer and that this backend cannot honour (penalties, logit biases, ...)
is refused with a 400 naming it, never answered as if it had not been sent. The
error hierarchy below is mapped to OpenAI-style JSON (`{"error": {"message", "type", "param", "code"}}`) by
the server in one place.

    ApiError                  status, type, code, param, message
      BadRequest (400)        malformed JSON, wrong types, out-of-range values, prompts too long, n > 1,
                              fields it cannot honour
      NotFound (404)          unknown route
      Overloaded (429)        the engine's waiting queue is full
      EngineFailed (500)      the engine failed the request
      Unavailable (503)       the server is shutting down

This module knows nothing of tokenizers or the engine; the server turns a request into prompt ids and
`SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pinned_backend.sampling import MAX_TOP_LOGPROBS

MAX_COMPLETION_LOGPROBS = 5
MAX_EMBEDDING_INPUTS = 2048  # as OpenAI's embeddings API


class ApiError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class Overloaded(ApiError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class EngineFailed(ApiError):
    status = 500
    type = "server_error"
    code = "engine_error"


class Unavailable(ApiError):
    status = 503
    type = "server_error"
    code = "shutting_down"


class _Request(BaseModel):
    # strict: "5" is not a number and 1 is not a boolean; extra: clients send fields we do not use.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class TextPart(_Request):
    type: Literal["text"]
    text: str


_NAME = r"^[A-Za-z0-9_.-]{1,64}$"  # OpenAI's rule for a function's name


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedTool(_Request):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # a `function` message's function
    tool_calls: list[ToolCall] | None = None  # an assistant's
    function_call: FunctionCall | None = None  # an assistant's, in the legacy shape
    tool_call_id: str | None = None  # a `tool` message's

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # honoured either way: the output always follows the schema


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Decoding(_Request):
    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # What the output must be (structured.py): OpenAI's response_format, or one of vLLM's guided_* fields.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise BadRequest("stop strings must not be empty", param="stop")
        return tuple(stops)


class ChatRequest(_Decoding):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprob_count(self) -> int:
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        return self.top_logprobs or 0


class CompletionRequest(_Decoding):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | list[int]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: Literal[False] = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def top_logprob_count(self) -> int:
        return self.logprobs or 0


class EmbeddingRequest(_Request):
    model: str | None = None
    input: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None

    def inputs(self) -> list[str | list[int]]:
        """One entry per vector to return: a text, or the token ids of one input."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [self.input]  # type: ignore[list-item]
        return list(self.input)  # type: ignore[arg-type]


def _absent(*harmless: Any) -> Callable[[Any], bool]:
    """A field's value that asks for nothing: null, or one of `harmless` (compared by type too, so 0 is not False)."""
    return lambda value: value is None or any(type(value) is type(h) and value == h for h in harmless)


_SAMPLING = "this backend's sampler has no such adjustment"
# What a client may send that would change the answer, with the values that leave it unchanged. Anything else is
# refused: an answer computed without what was asked for would pretend to be the answer to it.
CHAT_UNHONOURED: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (_absent({}), _SAMPLING),
    "presence_penalty": (_absent(0, 0.0), _SAMPLING),
    "frequency_penalty": (_absent(0, 0.0), _SAMPLING),
    "repetition_penalty": (_absent(1, 1.0), _SAMPLING),
    "min_p": (_absent(0, 0.0), _SAMPLING),
    "min_tokens": (_absent(0), _SAMPLING),
    "reasoning_effort": (_absent(), "this backend has no reasoning mode"),
    "modalities": (_absent(["text"]), "this backend answers with text only"),
    "audio": (_absent(), "this backend answers with text only"),
    "prediction": (_absent(), "this backend takes no predicted output"),
    "web_search_options": (_absent(), "this backend cannot search the web"),
}
COMPLETION_UNHONOURED: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    **{key: CHAT_UNHONOURED[key] for key in ("logit_bias", "presence_penalty", "frequency_penalty")},
    **{key: CHAT_UNHONOURED[key] for key in ("repetition_penalty", "min_p", "min_tokens")},
    "best_of": (_absent(1), "this backend serves one completion per request"),
    "suffix": (_absent(""), "this backend does not fill in the middle"),
}
# Per chat message.
MESSAGE_UNHONOURED: Mapping[str, tuple[Callable[[Any], bool], str]] = {
    "audio": (_absent(), "this backend reads text only"),
}


def refuse_unhonoured(body: Any, fields: Mapping[str, tuple[Callable[[Any], bool], str]]) -> None:
    """A 400 naming the first field of `body` (and of its chat messages) that this backend cannot honour."""
    if not isinstance(body, dict):
        return
    _refuse_fields(body, fields, "")
    if fields is CHAT_UNHONOURED and isinstance(body.get("messages"), list):
        for i, message in enumerate(body["messages"]):
            if isinstance(message, dict):
                _refuse_fields(message, MESSAGE_UNHONOURED, f"messages.{i}.")


def _refuse_fields(
    body: dict[str, Any], fields: Mapping[str, tuple[Callable[[Any], bool], str]], prefix: str
) -> None:
    for key, (harmless, why) in fields.items():
        if key in body and not harmless(body[key]):
            raise BadRequest(
                f"{prefix}{key}: {why}, so it cannot honour {body[key]!r:.80}; leave it out, or pin a stack "
                "that can",
                param=f"{prefix}{key}",
            )


R = TypeVar("R", bound=_Request)
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "none"})


def parse_request(model: type[R], body: Any) -> R:
    """Validate a decoded JSON body; the first problem becomes a 400 that names the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        # A union reports one error per branch; a range error says more than "not a string" does, and the branch
        # that got deepest into the value is the one the client meant.
        specific = [e for e in errors if not e["type"].endswith("_type") and e["type"] != "none_required"]
        error = max(specific or errors, key=lambda e: len(e["loc"]))
        # Unions add their branch's type or model to the location ("content.str", "tool_choice.NamedTool"); a
        # client knows the field only.
        loc = [str(p) for p in error["loc"] if p not in _TYPE_NAMES and not _branch(str(p))]
        param = ".".join(loc) or None
        raise BadRequest(f"{param}: {_explain(error)}", param=param) from None


def _branch(part: str) -> bool:
    return "[" in part or part[:1].isupper()


def _explain(error: Any) -> str:
    kind, message = error["type"], error["msg"]
    if kind == "missing":
        return "this field is required"
    if kind == "literal_error" and error["loc"] == ("echo",):
        return "echo is not supported; leave it out or set it to false"
    if kind == "literal_error" and error["loc"][0] in ("tools", "tool_choice") and error["loc"][-1] == "type":
        return f"only tools of type 'function' are served here, not {error.get('input')!r}"
    if error["loc"] == ("n",) and kind == "less_than_equal":
        return "only n = 1 is supported; send one request per completion"
    return f"{message} (got {error.get('input')!r})"
