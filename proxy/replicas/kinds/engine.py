"""What the engine kinds share: a stack reported by a running engine, and OpenAI-shaped answers with tokens.

An engine kind names the documents its server describes itself with (`Documents`: paths to GET or POST, their
answers by path) and builds a stack from them with a pure function, so that every kind is tested on its documents
alone. What the engine does not report is said in the stack: `weights_sha256` is null unless it reports a digest,
a string key it cannot fill is "unknown", a software version it does not give is null, and `engine.unreported`
lists them. Nothing proves a reported stack; a changed one quarantines the replica like any other (invariant 3).

Answers: where an engine gives choice 0's token ids (a `token_ids` list on the choice, or an `id` on each logprob
entry) and logprobs (`logprobs.content[].logprob` for chat, `logprobs.token_logprobs` for completions), they are
copied into the `stackpin` extension that records and replays read (docs/protocol.md), for a whole answer and for
each stream chunk alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from pydantic import ValidationError

from proxy.endpoints import CHAT, COMPLETIONS, RESPONSES
from proxy.errors import ReplicaGarbage, ReplicaRejected, ReplicaUnavailable, StackpinError, relayed_error
from proxy.replicas.forward import Described, get_bytes, post_json
from proxy.replicas.kinds.base import KindSettings, StackSource, Target
from proxy.stack import SOFTWARE_KEYS, UNKNOWN, Stack, fingerprint

if TYPE_CHECKING:
    from proxy.replicas.registry import ReplicaSnapshot

Documents = Mapping[str, Any]  # path -> the parsed JSON answer, or the text of a non-JSON one (/metrics)


@dataclass(frozen=True)
class Fetch:
    """One document a kind describes itself with: GET `path` (JSON unless `text`), or POST `body` to it (built
    from the target and the documents fetched before it). Kept under `key` (default: the path)."""

    path: str
    text: bool = False
    body: Callable[[Target, Documents], dict[str, Any]] | None = None
    optional: bool = (
        False  # not every release or setting has it: absent from the documents, not a failed check
    )
    key: str | None = None


async def fetch_all(
    session: aiohttp.ClientSession, target: Target, wanted: tuple[Fetch, ...]
) -> dict[str, Any]:
    documents: dict[str, Any] = {}
    for fetch in wanted:
        try:
            documents[fetch.key or fetch.path] = await _fetch_one(session, target, fetch, documents)
        except (ReplicaRejected, ReplicaGarbage) as e:
            if not fetch.optional:
                raise ReplicaUnavailable(f"{target.url}{fetch.path}: {e}", down=False) from e
    return documents


async def _fetch_one(
    session: aiohttp.ClientSession, target: Target, fetch: Fetch, documents: Documents
) -> Any:
    url = target.url + fetch.path
    if fetch.body is not None:
        body = fetch.body(target, documents)
        answer = await post_json(session, url, body, api_key=target.api_key, timeout_s=target.timeout_s)
        return answer.body
    raw = await get_bytes(session, url, timeout_s=target.timeout_s, api_key=target.api_key)
    if fetch.text:
        return raw.decode("utf-8", "replace")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ReplicaGarbage(f"{fetch.path} is not JSON") from e


def reported_stack(
    *,
    engine: str,
    version: str | None,
    model: str,
    quantisation: str | None,
    hardware: str | None,
    batching: dict[str, Any],
    details: dict[str, Any],
    kernel_mode: str | None = None,
    software: Mapping[str, str | None] | None = None,
    weights_sha256: str | None = None,
    hardware_detail: dict[str, Any] | None = None,
) -> Stack:
    """A reported stack, saying what the engine left unsaid: "unknown" keys, null versions, `unreported`."""
    versions: dict[str, str | None] = dict.fromkeys(SOFTWARE_KEYS)
    versions.update(software or {})
    versions["backend"] = f"{engine} {version}" if version else None
    unreported = [key for key, value in (("weights_sha256", weights_sha256),) if value is None]
    named = (("quantisation", quantisation), ("hardware", hardware), ("kernel_mode", kernel_mode))
    unreported += [key for key, value in named if not value]
    unreported += [] if hardware_detail else ["hardware_detail"]
    unreported += [f"software.{key}" for key, value in versions.items() if value is None]
    return Stack.model_validate(
        {
            "schema": 1,
            "model": model,
            "weights_sha256": weights_sha256,
            "quantisation": quantisation or UNKNOWN,
            "hardware": hardware or UNKNOWN,
            "hardware_detail": hardware_detail or {},
            "kernel_mode": kernel_mode or UNKNOWN,
            "software": versions,
            "batching": batching,
            "engine": {"name": engine, **details, "unreported": sorted(set(unreported))},
        }
    )


class Engine:
    """The defaults of a kind whose running server reports its stack and speaks OpenAI's chat and completions.

    A subclass names itself, the documents it fetches and `stack_of`, the pure build of its stack from them."""

    name = "engine"
    source = StackSource.REPORTED
    documents: tuple[Fetch, ...] = ()
    needs_model = False  # True for an engine that serves several models and is asked about one (`model`)

    def stack_of(self, documents: Documents, target: Target) -> Stack:
        raise NotImplementedError

    def validate(self, settings: KindSettings) -> None:
        if settings.stack is not None or settings.endpoints is not None:
            raise ValueError(
                f"a {self.name} replica reports its own stack and routes: leave out 'stack' and 'endpoints' "
                '(kind = "upstream" declares them)'
            )
        if self.needs_model and not settings.model:
            raise ValueError(
                f"a {self.name} replica serves several models: name the one it serves with 'model'"
            )
        if not self.needs_model and settings.model is not None:
            raise ValueError(f"a {self.name} replica reports the model it serves: leave out 'model'")

    def endpoints(self, declared: list[str] | None) -> frozenset[str]:
        return frozenset({CHAT, COMPLETIONS})

    def translated(self) -> frozenset[str]:
        return frozenset({RESPONSES})

    async def describe(self, session: aiohttp.ClientSession, target: Target) -> Described:
        documents = await fetch_all(session, target, self.documents)
        try:
            stack = self.stack_of(documents, target)
            document = stack.document()
            computed = fingerprint(document)
        except (KeyError, IndexError, TypeError, ValueError, ValidationError) as e:
            raise ReplicaUnavailable(
                f"{self.name} at {target.url} did not describe a stack: {type(e).__name__}: {str(e)[:300]}",
                down=False,
            ) from e
        # A reported stack claims no fingerprint of its own: nothing to contradict.
        return Described(stack, document, computed, computed)

    def forwarded(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """Logprobs of the sampled tokens, unless the client said otherwise."""
        if endpoint == CHAT and "logprobs" not in body:
            return {**body, "logprobs": True}
        if endpoint == COMPLETIONS and "logprobs" not in body:
            return {**body, "logprobs": 0}
        return body

    def answered(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        tokens = choice_tokens(body)
        if tokens is None:
            return body
        extension = body.get("stackpin") if isinstance(body.get("stackpin"), dict) else {}
        return {**body, "stackpin": {**extension, **tokens}}

    def check_answer(
        self, replica: ReplicaSnapshot, stack_header: str | None, body: dict[str, Any] | None
    ) -> None:
        return None  # an engine's answers name no stack; its health checks watch it

    def rejected(self, error: ReplicaRejected) -> StackpinError:
        """A 404 is the engine's fault, not the client's: the proxy names the model the engine reported, so an
        engine that no longer knows it (unloaded, or replaced under another name) is failing, and a twin may not be.
        Ollama's errors are a bare string; it becomes the message."""
        message = error.replica_body.get("error")
        if isinstance(message, str):
            error = ReplicaRejected(
                error.status, {"error": {"message": message, "type": "invalid_request_error"}}
            )
        if error.status == 404:
            text = relayed_error(error.replica_body)["error"]["message"]
            return ReplicaUnavailable(
                f"{self.name} no longer serves the model it reported: {text}", down=False
            )
        return error


def choice_tokens(body: dict[str, Any]) -> dict[str, Any] | None:
    """Choice 0's token ids, logprobs and prompt token ids, where the answer (or chunk) holds them."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    found: dict[str, Any] = {}
    entries = _logprob_entries(choice.get("logprobs"))
    ids = choice.get("token_ids")
    if (
        not _ints(ids)
        and entries is not None
        and all(isinstance(e, dict) and _int(e.get("id")) for e in entries)
    ):
        ids = [e["id"] for e in entries]
    if _ints(ids):
        found["token_ids"] = ids
    logprobs = _logprob_values(choice.get("logprobs"), entries)
    if logprobs is not None and "token_ids" in found and len(logprobs) == len(found["token_ids"]):
        found["token_logprobs"] = logprobs
    prompt_ids = choice.get("prompt_token_ids", body.get("prompt_token_ids"))
    if _ints(prompt_ids) and prompt_ids:
        found["prompt_token_ids"] = prompt_ids
    return found or None


def _logprob_entries(logprobs: Any) -> list[Any] | None:
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
        return logprobs["content"]
    return None


def _logprob_values(logprobs: Any, entries: list[Any] | None) -> list[float] | None:
    if entries is not None:
        values = [e.get("logprob") if isinstance(e, dict) else None for e in entries]
    elif isinstance(logprobs, dict) and isinstance(logprobs.get("token_logprobs"), list):
        values = logprobs["token_logprobs"]
    else:
        return None
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return [float(v) for v in values]
    return None


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(_int(v) for v in value)


def dtype_name(value: Any) -> str | None:
    """An engine's dtype as the stack names dtypes (`bf16`, `fp16`, `fp32`); other names as they are."""
    if not isinstance(value, str) or not value or value == "auto":
        return None
    text = value.removeprefix("torch.")
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(
        text, text
    )
