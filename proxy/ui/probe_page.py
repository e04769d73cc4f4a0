"""The probe page: one request sent N times at concurrency C from the browser, and how many distinct answers came
back, with where each diverged from the most common.

It is `stackpin probe` run inside the proxy: the same tally (`proxy/evidence/probe.py`), with each request sent through the
API's own serving path (`serve_completion`) as the viewer's tenant, so every probe request is pinned, rate
limited, recorded and counted like any other. The form's bounds keep one click from flooding a fleet.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from proxy.app_keys import REGISTRY, ROUTES
from proxy.errors import StackpinError
from proxy.evidence.probe import ProbeResult, Reply, probe_body, run_probe
from proxy.serving.handlers import serve_completion
from proxy.serving.request import CHAT
from proxy.serving.router import live_stacks
from proxy.ui.chart import chart
from proxy.ui.render import render
from proxy.ui.security import VIEWER

BOUNDS = {"requests": (1, 256), "concurrency": (1, 32), "max_tokens": (1, 512)}
DEFAULTS = {
    "prompt": "Tell me a short story about a lighthouse.",
    "pin": "",
    "requests": "16",
    "concurrency": "4",
    "max_tokens": "32",
    "temperature": "0",
}


@dataclass(frozen=True)
class ProbeForm:
    model: str
    prompt: str
    pin: str | None
    requests: int
    concurrency: int
    max_tokens: int
    temperature: float


def read_form(form: Mapping[str, Any]) -> tuple[ProbeForm | None, list[str]]:
    text = {key: str(form.get(key, "")).strip() for key in ("model", *DEFAULTS)}
    problems = []
    if not text["model"]:
        problems.append("model: name a model or a route")
    if not text["prompt"]:
        problems.append("prompt: write the message to send")
    numbers: dict[str, int] = {}
    for key, (low, high) in BOUNDS.items():
        try:
            numbers[key] = int(text[key])
        except ValueError:
            numbers[key] = 0
        if not low <= numbers[key] <= high:
            problems.append(f"{key.replace('_', ' ')}: a whole number from {low} to {high}")
    try:
        temperature = float(text["temperature"])
    except ValueError:
        temperature = -1.0
    if not 0 <= temperature <= 2:
        problems.append("temperature: a number from 0 to 2")
    if problems:
        return None, problems
    return ProbeForm(
        model=text["model"],
        prompt=text["prompt"],
        pin=text["pin"] or None,
        temperature=temperature,
        **numbers,
    ), []


async def probe_form(request: web.Request) -> web.Response:
    return _page(request, {**DEFAULTS, "model": (_models(request) or [""])[0]}, [], None)


async def probe(request: web.Request) -> web.Response:
    form = await request.post()
    wanted, problems = read_form(form)
    shown = {key: str(form.get(key, "")) for key in ("model", *DEFAULTS)}
    if wanted is None:
        return _page(request, shown, problems, None, status=400)
    tenant = request[VIEWER].tenant
    config = request.config_dict

    async def send() -> Reply:
        body = probe_body(
            wanted.model, wanted.prompt, max_tokens=wanted.max_tokens, temperature=wanted.temperature
        )
        try:
            response = await serve_completion(config, tenant, CHAT, body, wanted.pin, None)
        except StackpinError as e:
            return e.status, {}, e.body()
        assert isinstance(response, web.Response) and isinstance(response.body, bytes)  # never a stream
        return response.status, response.headers, json.loads(response.body)

    result = await run_probe(send, requests=wanted.requests, concurrency=wanted.concurrency)
    return _page(request, shown, [], result)


def _page(
    request: web.Request,
    form: dict[str, str],
    problems: list[str],
    result: ProbeResult | None,
    *,
    status: int = 200,
) -> web.Response:
    return render(
        request,
        "probe.html",
        status=status,
        form=form,
        problems=problems,
        models=_models(request),
        result=result,
        chart=chart(result) if result is not None else None,
        firsts=_first_of_each_completion(result),
    )


def _first_of_each_completion(result: ProbeResult | None) -> dict[int, int]:
    """Completion number -> the row (from 1) of its most common variant, where its text is shown."""
    firsts: dict[int, int] = {}
    for row, variant in enumerate(result.variants if result else [], start=1):
        firsts.setdefault(variant.completion, row)
    return firsts


def _models(request: web.Request) -> list[str]:
    live = {s["stack"]["model"] for s in live_stacks(request.config_dict[REGISTRY].all())}
    return sorted(live) + sorted(set(request.config_dict[ROUTES]) - live)
