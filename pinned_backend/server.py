"""The backend's HTTP face: the OpenAI routes (chat and text completions, embeddings, models), the stack
description, health and metrics, on aiohttp.

`create_app(settings)` builds the application. Its one resource, the loaded runtime with its engine thread,
lives in a `cleanup_ctx` and hangs on a typed `AppKey`. Handlers parse and validate the request
(protocol.py), turn it into prompt ids (with the tools it offers: tool_prompt.py) and sampling parameters with the
grammar its answer follows (structured.py, tool_grammar.py), hand it to the engine, and write the answer
(responses.py, its tool calls read back by tool_calls.py) as one JSON body or as server-sent events. Errors become OpenAI-style JSON in one middleware.
Every response carries the stack's fingerprint in the `Stackpin-Stack` header.

The server decides nothing about scheduling or sampling, and never touches the model or its cache directly.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pinned_backend.allocator import keep_freed_memory
from pinned_backend.embeddings import EmbeddingJob
from pinned_backend.engine import EngineError, EngineStopped, QueueFull, RequestTooLarge, TokenOutput
from pinned_backend.grammar import CompiledGrammar, GrammarError
from pinned_backend.metrics import BackendMetrics
from pinned_backend.protocol import (
    CHAT_UNHONOURED,
    COMPLETION_UNHONOURED,
    ApiError,
    BadRequest,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    EngineFailed,
    NotFound,
    Overloaded,
    Unavailable,
    parse_request,
    refuse_unhonoured,
)
from pinned_backend.responses import (
    Completion,
    Meta,
    first_chunk,
    full_body,
    token_chunk,
    usage_chunk,
)
from pinned_backend.runtime import BackendSettings, Runtime, load_runtime
from pinned_backend.sampling import SamplingParams, draw_seed
from pinned_backend.stack import fingerprint
from pinned_backend.structured import Constraint, requested_constraint
from pinned_backend.tokenizer import Tokenizer
from pinned_backend.tool_calls import CallReader
from pinned_backend.tool_grammar import answer_constraint, tag_tokens
from pinned_backend.tool_prompt import chat_prompt, renders_tools
from pinned_backend.tools import ToolPlan, tool_plan

STACK_HEADER = "Stackpin-Stack"

RUNTIME = web.AppKey("runtime", Runtime)
SETTINGS = web.AppKey("settings", BackendSettings)
METRICS = web.AppKey("metrics", BackendMetrics)
REGISTRY = web.AppKey("registry", CollectorRegistry)
FINGERPRINT = web.AppKey("fingerprint", str)
SEEDS = web.AppKey("seeds", random.Random)
CLOCK = web.AppKey("clock", Callable[[], float])  # type: ignore[arg-type]
REPORT = web.AppKey("report", Callable[[str], None])  # type: ignore[arg-type]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(
    settings: BackendSettings,
    *,
    seeds: random.Random | None = None,
    clock: Callable[[], float] = time.time,
    report: Callable[[str], None] = lambda _: None,
) -> web.Application:
    """`seeds` draws the seed of a sampled request that sent none; `clock` stamps `created`; `report` hears
    each step of loading the model."""
    app = web.Application(middlewares=[_errors_and_headers])
    app[SETTINGS] = settings
    app[REGISTRY] = CollectorRegistry()
    app[METRICS] = BackendMetrics(app[REGISTRY])
    app[SEEDS] = seeds or random.Random()
    app[CLOCK] = clock
    app[REPORT] = report
    app.cleanup_ctx.append(_runtime_ctx)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/embeddings", _embeddings)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model_id:.+}", _model)
    app.router.add_get("/v1/stack", _stack)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    return app


async def _runtime_ctx(app: web.Application) -> AsyncIterator[None]:
    metrics = app[METRICS]
    loop = asyncio.get_running_loop()
    # One thread loads the model and then steps it (runner.py says why); closing runs elsewhere, since it waits for
    # that thread's loop to end.
    if torch.device(app[SETTINGS].device).type == "cpu":
        keep_freed_memory()  # before the engine's thread exists, so that it shares the tuned arena
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stackpin-engine")
    try:
        runtime = await loop.run_in_executor(
            engine_thread, load_runtime, app[SETTINGS], metrics.observe_step, app[REPORT]
        )
        app[RUNTIME] = runtime
        app[FINGERPRINT] = fingerprint(runtime.stack)
        metrics.set_stack(runtime.stack, app[FINGERPRINT])
        runtime.runner.start(engine_thread)
        try:
            yield
        finally:
            await loop.run_in_executor(None, runtime.close)
    finally:
        engine_thread.shutdown(wait=False)


@web.middleware
async def _errors_and_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place errors become OpenAI-style JSON; also stamps the stack header and counts the answer."""
    try:
        response = await handler(request)
    except ApiError as exc:
        response = web.json_response(exc.body(), status=exc.status)
        if isinstance(exc, Overloaded):
            response.headers["Retry-After"] = "1"  # the queue drains by the step; a second is plenty
    except web.HTTPNotFound:
        response = web.json_response(NotFound(f"no route {request.method} {request.path}").body(), status=404)
    except web.HTTPMethodNotAllowed as exc:
        body = BadRequest(
            f"{request.method} is not allowed on {request.path}; use {', '.join(exc.allowed_methods)}"
        )
        response = web.json_response(body.body(), status=405)
    except web.HTTPException as exc:  # aiohttp's own refusals, e.g. a body over client_max_size (413)
        body = BadRequest(f"{exc.reason}: {exc.text}" if exc.text else exc.reason)
        response = web.json_response(body.body(), status=exc.status)
    if not response.prepared and FINGERPRINT in request.app:
        response.headers[STACK_HEADER] = request.app[FINGERPRINT]
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "unmatched"
    request.app[METRICS].observe_request(endpoint, response.status)
    return response


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None


async def _chat(request: web.Request) -> web.StreamResponse:
    raw = await _json_body(request)
    refuse_unhonoured(raw, CHAT_UNHONOURED)
    body = parse_request(ChatRequest, raw)
    runtime = request.app[RUNTIME]
    tools = tool_plan(body)
    prompt_ids = _chat_prompt_ids(runtime.tokenizer, body, tools)
    constraint = answer_constraint(body, tools, tag_tokens(runtime.tokenizer))
    return await _serve(
        request, body, prompt_ids, chat=True, logprobs=body.logprobs, constraint=constraint, tools=tools
    )


def _chat_prompt_ids(tokenizer: Tokenizer, body: ChatRequest, tools: ToolPlan | None) -> list[int]:
    own_tools = renders_tools(tokenizer.chat_template, tokenizer.takes_tools)
    messages, extra = chat_prompt(body.messages, tools, own_tools)
    try:
        return tokenizer.encode_chat(messages, **extra)
    except ValueError as exc:
        raise BadRequest(f"messages: {exc}", param="messages") from None


async def _completions(request: web.Request) -> web.StreamResponse:
    raw = await _json_body(request)
    refuse_unhonoured(raw, COMPLETION_UNHONOURED)
    body = parse_request(CompletionRequest, raw)
    runtime = request.app[RUNTIME]
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        vocab = runtime.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):  # type: ignore[operator]
            raise BadRequest(f"prompt: token ids must lie in [0, {vocab})", param="prompt")
        prompt_ids = list(prompt)
    else:
        text = prompt if isinstance(prompt, str) else prompt[0]
        prompt_ids = runtime.tokenizer.encode(text)  # type: ignore[arg-type]
    return await _serve(
        request,
        body,
        prompt_ids,
        chat=False,
        logprobs=body.logprobs is not None,
        constraint=requested_constraint(body),
    )


def _sampling_params(
    body: ChatRequest | CompletionRequest, prompt_len: int, runtime: Runtime, seeds: random.Random
) -> SamplingParams:
    context = runtime.max_model_len
    if prompt_len == 0:
        raise BadRequest("the prompt is empty; send at least one token", param="prompt")
    if prompt_len >= context:
        raise BadRequest(
            f"the prompt has {prompt_len} tokens; the model's context is {context}: shorten the prompt",
            param="messages" if isinstance(body, ChatRequest) else "prompt",
        )
    requested = body.requested_max_tokens()
    room = context - prompt_len
    if requested is not None and requested > room:
        raise BadRequest(
            f"max_tokens is {requested}, but the prompt's {prompt_len} tokens leave room for {room} "
            f"in the model's context of {context}: lower max_tokens",
            param="max_tokens",
        )
    if requested is None:
        # Unasked, an answer takes what the context and the KV cache leave, up to the default; a prompt that leaves
        # the cache no room at all is refused for what it is (Engine.submit).
        cache_room = runtime.engine.kv_capacity_tokens - prompt_len
        max_tokens = max(1, min(room, cache_room, runtime.settings.default_max_tokens))
    else:
        max_tokens = requested
    seed = body.seed
    if body.temperature > 0 and seed is None:
        seed = draw_seed(seeds)
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=seed if body.temperature > 0 else body.seed,
        max_tokens=max_tokens,
        stop=body.stop_strings(),
        top_logprobs=body.top_logprob_count(),
    )


async def _serve(
    request: web.Request,
    body: ChatRequest | CompletionRequest,
    prompt_ids: list[int],
    *,
    chat: bool,
    logprobs: bool,
    constraint: Constraint | None = None,
    tools: ToolPlan | None = None,
) -> web.StreamResponse:
    """Serve one completion; `constraint`, if any, is the grammar its output must follow; `tools`, the tools a
    chat answer may call, whose calls are read out of its text."""
    app = request.app
    runtime = app[RUNTIME]
    params = _sampling_params(body, len(prompt_ids), runtime, app[SEEDS])
    if constraint is not None:
        params = replace(params, grammar=await _compiled(runtime, constraint))
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    meta = Meta(request_id, int(app[CLOCK]()), runtime.settings.served_name, app[FINGERPRINT], chat)
    seed = params.seed if not params.greedy else None
    calls = CallReader(prompt_ids, seed, tools.legacy) if tools is not None and tools.callable else None
    completion = Completion(prompt_ids, seed, calls=calls)
    queue: asyncio.Queue[TokenOutput | EngineError] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def sink(event: TokenOutput | EngineError) -> None:  # called on the engine's thread
        loop.call_soon_threadsafe(queue.put_nowait, event)

    try:
        runtime.runner.submit(request_id, prompt_ids, params, sink)
    except QueueFull as exc:
        raise Overloaded(str(exc)) from None
    except RequestTooLarge as exc:
        prompt_param = "messages" if chat else "prompt"
        raise BadRequest(str(exc), param=prompt_param if exc.param == "prompt" else "max_tokens") from None
    token_text = runtime.pieces.piece
    try:
        if not body.stream:
            while completion.finish_reason is None:
                completion.outputs.append(_checked(await queue.get()))
            return web.json_response(full_body(meta, completion, logprobs, token_text))
        return await _stream(request, body, meta, completion, queue, logprobs)
    finally:
        if completion.finish_reason is None:
            runtime.runner.cancel(request_id)


async def _compiled(runtime: Runtime, constraint: Constraint) -> CompiledGrammar:
    """The constraint's grammar compiled off the event loop (a large grammar takes a while); a 400 naming the
    field when the grammar engine cannot honour it."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, runtime.grammars.compile, constraint.grammar)
    except GrammarError as exc:
        raise BadRequest(
            f"{constraint.param}: {str(exc).strip()}; this backend cannot constrain its output to that, so it refuses rather "
            "than answer unconstrained",
            param=constraint.param,
        ) from None


def _checked(event: TokenOutput | EngineError) -> TokenOutput:
    if isinstance(event, EngineStopped):
        raise Unavailable(str(event))
    if isinstance(event, EngineError):
        raise EngineFailed(str(event))
    return event


async def _stream(
    request: web.Request,
    body: ChatRequest | CompletionRequest,
    meta: Meta,
    completion: Completion,
    queue: asyncio.Queue[TokenOutput | EngineError],
    logprobs: bool,
) -> web.StreamResponse:
    token_text = request.app[RUNTIME].pieces.piece
    # The first event is awaited before the headers go out, so an engine failure can still be a clean error.
    first = _checked(await queue.get())
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            STACK_HEADER: request.app[FINGERPRINT],
        }
    )
    await response.prepare(request)
    # A client that goes away ends the stream; _serve cancels its request in the engine.
    with contextlib.suppress(ConnectionResetError):
        await _write_events(response, body, meta, completion, queue, first, logprobs, token_text)
    return response


async def _write_events(
    response: web.StreamResponse,
    body: ChatRequest | CompletionRequest,
    meta: Meta,
    completion: Completion,
    queue: asyncio.Queue[TokenOutput | EngineError],
    event: TokenOutput | EngineError,
    logprobs: bool,
    token_text: Callable[[int], str],
) -> None:
    async def send(payload: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())

    if meta.chat:
        await send(first_chunk(meta, calls=completion.calls is not None))
    while True:
        if isinstance(event, EngineError):
            await send(_checked_error(event))  # the headers are gone: the error travels as an event
            await response.write_eof()
            return
        start = len(completion.outputs)
        completion.outputs.append(event)
        await send(token_chunk(meta, completion, start, logprobs, token_text))
        if completion.finish_reason is not None:
            break
        event = await queue.get()
    if body.stream_options is not None and body.stream_options.include_usage:
        await send(usage_chunk(meta, completion))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


def _checked_error(event: EngineError) -> dict[str, Any]:
    error: ApiError = (
        Unavailable(str(event)) if isinstance(event, EngineStopped) else EngineFailed(str(event))
    )
    return error.body()


async def _embeddings(request: web.Request) -> web.Response:
    body = parse_request(EmbeddingRequest, await _json_body(request))
    runtime = request.app[RUNTIME]
    inputs = [_input_ids(runtime, i, given) for i, given in enumerate(body.inputs())]
    hidden = runtime.model.config.hidden_size
    if body.dimensions is not None and body.dimensions > hidden:
        raise BadRequest(
            f"dimensions: the model's vectors have {hidden}; ask for at most that", param="dimensions"
        )
    for i, ids in enumerate(inputs):
        try:
            runtime.pooling.check(i, ids)
        except RequestTooLarge as exc:
            raise BadRequest(str(exc), param="input") from None
    loop = asyncio.get_running_loop()
    result: asyncio.Future[list[torch.Tensor] | EngineError] = loop.create_future()
    job = EmbeddingJob(
        runtime.model,
        runtime.engine.cache,
        runtime.engine.allocator,
        runtime.engine.device,
        runtime.pooling,
        inputs,
        body.dimensions,
        lambda outcome: loop.call_soon_threadsafe(result.set_result, outcome),
    )
    try:
        runtime.runner.add_chore(job)
    except EngineStopped as exc:
        raise Unavailable(str(exc)) from None
    try:
        outcome = await result
    finally:
        job.cancelled = not result.done()  # the client left: the job stops at its next turn
    if isinstance(outcome, EngineError):
        _checked(outcome)  # raises
    assert isinstance(outcome, list)
    return web.json_response(_embedding_body(request.app, body, inputs, outcome))


def _input_ids(runtime: Runtime, index: int, given: str | list[int]) -> list[int]:
    if isinstance(given, str):
        return runtime.tokenizer.encode(given)
    vocab = runtime.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in given):
        raise BadRequest(f"input: token ids of input {index} must lie in [0, {vocab})", param="input")
    return list(given)


def _embedding_body(
    app: web.Application, body: EmbeddingRequest, inputs: list[list[int]], vectors: list[torch.Tensor]
) -> dict[str, Any]:
    def encoded(vector: torch.Tensor) -> list[float] | str:
        if body.encoding_format == "base64":  # float32 little-endian, as OpenAI's
            return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
        return vector.tolist()

    tokens = sum(len(ids) for ids in inputs)
    runtime = app[RUNTIME]
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
        "model": runtime.settings.served_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "system_fingerprint": app[FINGERPRINT],
        "stackpin": {"input_token_ids": inputs, "embedding": runtime.stack["embedding"]},
    }


def _model_object(runtime: Runtime) -> dict[str, Any]:
    return {"id": runtime.settings.served_name, "object": "model", "created": 0, "owned_by": "stackpin"}


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_object(request.app[RUNTIME])]})


async def _model(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    model_id = request.match_info["model_id"]
    if model_id != runtime.settings.served_name:
        raise NotFound(
            f"no model {model_id!r}; this server serves {runtime.settings.served_name!r}", param="model"
        )
    return web.json_response(_model_object(runtime))


async def _stack(request: web.Request) -> web.Response:
    return web.json_response({"stack": request.app[RUNTIME].stack, "fingerprint": request.app[FINGERPRINT]})


async def _healthz(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    if not runtime.runner.alive:
        raise Unavailable("the engine thread is not running")
    return web.json_response({"status": "ok", "queue_depth": runtime.engine.queue_depth})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
