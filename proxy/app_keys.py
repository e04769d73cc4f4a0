"""The typed application keys under which create_app (proxy/app.py) hangs shared state.

Set when the application is built: the settings, the secrets, the metrics, the redactor, the named routes and the
prompt book. Set by the cleanup context of each resource, in the order they are acquired: the audit store, the
HTTP client for replicas, the embedded local backend as a replica and the fleet's link to Redis (each only when there is
one), the registry with its health monitor, the fleet, the serving path built from them all, and the stored
state (proxy/state/) with the runner of its jobs, which serve through that path.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from proxy.audit import AuditStore
from proxy.config import Secrets, Settings
from proxy.fleet.link import FleetLink
from proxy.fleet.resource import Fleet
from proxy.metrics import ProxyMetrics
from proxy.pins import Pin
from proxy.replicas.health import HealthMonitor
from proxy.replicas.registry import Registry, Replica
from proxy.serving.prompts import PromptBook
from proxy.serving.redact import Redactor
from proxy.serving.serve import Proxy
from proxy.state.runner import JobRunner
from proxy.state.store import StateStore

SETTINGS = web.AppKey("settings", Settings)
SECRETS = web.AppKey("secrets", Secrets)
METRICS = web.AppKey("metrics", ProxyMetrics)
REDACTOR = web.AppKey("redactor", Redactor)
ROUTES = web.AppKey("routes", dict[str, Pin])
PROMPTS = web.AppKey("prompts", PromptBook)

STORE = web.AppKey("store", AuditStore)
CLIENT_SESSION = web.AppKey("client_session", aiohttp.ClientSession)
LOCAL_REPLICAS = web.AppKey("local_replicas", list[Replica])
FLEET_LINK = web.AppKey("fleet_link", FleetLink)
REGISTRY = web.AppKey("registry", Registry)
HEALTH = web.AppKey("health", HealthMonitor)
FLEET = web.AppKey("fleet", Fleet)
PROXY = web.AppKey("proxy", Proxy)
STATE = web.AppKey("state", StateStore)
JOBS = web.AppKey("jobs", JobRunner)
