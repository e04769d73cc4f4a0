"""The typed application keys under which create_app hangs shared state."""

from __future__ import annotations

from aiohttp import web

from proxy.pins import Pin
from proxy.prompts import PromptBook
from proxy.serving import Proxy

PROXY = web.AppKey("proxy", Proxy)
ROUTES = web.AppKey("routes", dict[str, Pin])
PROMPTS = web.AppKey("prompts", PromptBook)
