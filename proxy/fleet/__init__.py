"""Fleet mode: many proxies sharing one Redis for their view of the replicas, and for per-tenant rate limits.

Switched on by `[fleet] redis_url`; without it the in-process registry (`proxy/replicas/registry.py`) is the whole truth,
which is right for one proxy. The pieces:

    documents.py   what lives in Redis under which key (leases, registrations, quarantines)
    heartbeat.py   the sidecar beside each backend: proves its stack and renews its lease
    state.py       the proxy's Redis client: read the fleet's view, publish quarantines, share outstanding counts
    sync.py        the periodic step that folds the shared view into the local registry, and staleness
    limits.py      per-tenant requests and tokens per minute, across proxies

Routing itself stays local and pure (`proxy/serving/router.py`): Redis is read in the background and written
fire-and-forget, never awaited while a request is being routed.
"""
