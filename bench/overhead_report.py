"""The proxy-overhead benchmark's figures made into what it prints and records: medians over rounds, per-round
ratios against the bare relay, the issue's targets met or missed, and a py-spy profile summed into shares.

Pure: takes the figures bench/proxy_overhead.py measured, returns text and dictionaries; measures nothing.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

# The targets, per store: added p50 at one client (ms), CPU per request against the bare relay's at many
# clients, throughput against the bare relay's, a stream's time to first byte over the bare relay's (ms).
ADDED_P50_MS = {"sqlite": 1.0, "postgres": 1.5}
CPU_RATIO_MAX = 2.0
THROUGHPUT_RATIO_MIN = 0.8
TTFB_OVER_MS = 1.0


def progress(figures: Any) -> str:
    cpu = (
        f" cpu/req {figures.cpu_ms_1:.2f}/{figures.cpu_ms_many:.2f} ms"
        if figures.cpu_ms_many is not None
        else ""
    )
    return (
        f"round {figures.round} {figures.target:22} p50 {figures.p50_ms:6.2f} ms  p99 {figures.p99_ms:6.2f} ms  "
        f"{figures.rps:6.0f} req/s{cpu}  ttfb {figures.ttfb_p50_ms:.2f} ms"
    )


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(results: list[Any]) -> dict[str, Any]:
    """Per target: medians over rounds of its figures, and of the ratios taken within each round."""
    by_round: dict[int, dict[str, Any]] = defaultdict(dict)
    for figures in results:
        by_round[figures.round][figures.target] = figures
    per_target: dict[str, dict[str, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    for round_figures in by_round.values():
        straight, bare = round_figures.get("straight"), round_figures.get("bare")
        for name, f in round_figures.items():
            row = per_target[name]
            for key in (
                "p50_ms",
                "p99_ms",
                "rps",
                "cpu_ms_1",
                "cpu_ms_many",
                "cpu_ms_many_loop",
                "ttfb_p50_ms",
                "commit_ms_1",
            ):
                row[key].append(getattr(f, key))
            if straight is not None and name != "straight":
                row["added_p50_ms"].append(f.p50_ms - straight.p50_ms)
                row["added_p99_ms"].append(f.p99_ms - straight.p99_ms)
                row["rps_vs_straight"].append(f.rps / straight.rps)
            if bare is not None and name not in ("straight", "bare"):
                row["rps_vs_bare"].append(f.rps / bare.rps)
                row["cpu_1_vs_bare"].append(_ratio(f.cpu_ms_1, bare.cpu_ms_1))
                row["cpu_many_vs_bare"].append(_ratio(f.cpu_ms_many, bare.cpu_ms_many))
                row["ttfb_over_bare_ms"].append(f.ttfb_p50_ms - bare.ttfb_p50_ms)
                row["p50_over_bare_ms"].append(f.p50_ms - bare.p50_ms)
    return {
        name: {"median": {key: _median(values) for key, values in row.items()}, "rounds": dict(row)}
        for name, row in per_target.items()
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets_met(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each stackpin target's figures against the issue's targets (medians over rounds)."""
    rows = []
    for name, figures in summary.items():
        if not name.startswith("stackpin-"):
            continue
        m = figures["median"]
        store = name.split("-")[1]
        checks = [
            ("added p50, 1 client", m.get("added_p50_ms"), f"<= {ADDED_P50_MS[store]} ms", ADDED_P50_MS[store], -1),
            ("CPU/request at many clients, x bare", m.get("cpu_many_vs_bare"), f"<= {CPU_RATIO_MAX}x",
             CPU_RATIO_MAX, -1),
            ("throughput, x bare", m.get("rps_vs_bare"), f">= {THROUGHPUT_RATIO_MIN}x", THROUGHPUT_RATIO_MIN, 1),
            ("stream TTFB over bare", m.get("ttfb_over_bare_ms"), f"<= {TTFB_OVER_MS} ms", TTFB_OVER_MS, -1),
        ]  # fmt: skip
        for label, value, wanted, bound, sense in checks:
            met = value is not None and (value - bound) * sense >= 0
            rows.append({"target": name, "figure": label, "value": value, "wanted": wanted, "met": met})
    return rows


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(document: dict[str, Any]) -> str:
    """The figures as a Markdown table (medians over rounds; ratios per round, then their median)."""
    concurrency = document["run"]["plan"]["concurrency"]
    lines = [
        f"| relay | p50 / p99 ms, 1 client | added p50 / p99 ms | over bare p50 ms | of which commit ms "
        f"| req/s, {concurrency} clients | x straight | x bare | CPU ms/req, 1 / {concurrency} "
        f"| of which event loop, {concurrency} | CPU x bare, 1 / {concurrency} | stream TTFB ms | TTFB - bare ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, figures in document["summary"].items():
        m = figures["median"]
        lines.append(
            f"| {name} | {_f(m['p50_ms'])} / {_f(m['p99_ms'])} | {_f(m.get('added_p50_ms'))} / "
            f"{_f(m.get('added_p99_ms'))} | {_f(m.get('p50_over_bare_ms'))} | {_f(m.get('commit_ms_1'))} | "
            f"{_f(m['rps'], 0)} | {_f(m.get('rps_vs_straight'), 3)} | "
            f"{_f(m.get('rps_vs_bare'), 3)} | {_f(m['cpu_ms_1'])} / {_f(m['cpu_ms_many'])} | "
            f"{_f(m['cpu_ms_many_loop'])} | "
            f"{_f(m.get('cpu_1_vs_bare'))} / {_f(m.get('cpu_many_vs_bare'))} | {_f(m['ttfb_p50_ms'])} | "
            f"{_f(m.get('ttfb_over_bare_ms'))} |"
        )
    return "\n".join(lines)


def targets_table(document: dict[str, Any]) -> str:
    lines = ["| relay | figure | median | target | met |", "| --- | --- | ---: | --- | --- |"]
    for row in targets_met(document["summary"]):
        lines.append(
            f"| {row['target']} | {row['figure']} | {_f(row['value'])} | {row['wanted']} | "
            f"{'yes' if row['met'] else '**no**'} |"
        )
    return "\n".join(lines)


def rounds_table(document: dict[str, Any]) -> str:
    """Each round's ratios against the bare relay, so that the spread is seen and not only the median."""
    lines = [
        "| relay | added p50 ms | throughput x bare | CPU x bare (many) | TTFB - bare ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, figures in document["summary"].items():
        if not name.startswith("stackpin-"):
            continue
        r = figures["rounds"]
        cells = [", ".join(_f(v) for v in r[key]) for key in
                 ("added_p50_ms", "rps_vs_bare", "cpu_many_vs_bare", "ttfb_over_bare_ms")]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- profile ----------------------------------------------------------------------------------------------------

# What a busy sample of the event loop thread is spent on, judged from its whole stack.
LOOP_ITSELF = ("Runner.run (", "run_until_complete (", "run_forever (")
CLIENT_FILES = ("aiohttp/client", "aiohttp/connector", "aiohttp/tracing")
LIBRARY_FILES = ("aiohttp/", "multidict/", "yarl/", "asyncio/")
# The proxy's subclass of aiohttp's connection handler: a sample there is in aiohttp's C parser it calls.
SERVER_SUBCLASS = "ProxyRequestHandler."
PARTS = (
    "HTTP server for the client (aiohttp)",
    "HTTP client to the replica (aiohttp)",
    "event loop and transports (uvloop's C, asyncio's Python)",
    "the relay's own work",
)
# The relay's own work, by the first of its steps found in the stack (bare's is only its handler).
OWN_STEPS = (
    ("read and check the request", ("read_request", "parse_body", "read_body", "authenticate",
                                    "Proxy.continued", "in_conversation", "RateLimiter.admit")),
    ("build and seal the record (canonical JSON, hashes)", ("Proxy._entry", "opened_entry", "closed_entry")),
    ("commit: queue, batch, hand-off to the writer (loop side)", ("AuditStore.append", "GroupCommitter.")),
    ("choose a replica, check its answer", ("Proxy._dispatch", "dispatch", "post_json", "open_stream")),
    ("answer, metrics, logs", ("Proxy.answer_response", "observe", "answered", "Proxy._count_tokens",
                               "Proxy._client_body", "Proxy._served")),
)  # fmt: skip


def _file(frame: str) -> str:
    return frame.rpartition(" (")[2]


def _part(frames: list[str]) -> str:
    leaf = frames[-1]
    if len(frames) == 1 or leaf.startswith(LOOP_ITSELF) or "asyncio/" in _file(leaf):
        return PARTS[2]
    if leaf.startswith(SERVER_SUBCLASS):
        return PARTS[0]
    if any(needle in _file(leaf) for needle in LIBRARY_FILES):
        in_client = any(any(n in _file(f) for n in CLIENT_FILES) for f in frames)
        return PARTS[1] if in_client else PARTS[0]
    return PARTS[3]


def _own_step(frames: list[str]) -> str:
    functions = {frame.split(" (", 1)[0] for frame in frames}
    for step, names in OWN_STEPS:
        if any(f == n or (n.endswith(".") and f.startswith(n)) for f in functions for n in names):
            return step
    return "other (the handler, middleware, ...)"


def request_costs(raw: str, loop_ms: float, other_ms: float, requests: int) -> dict[str, Any]:
    """py-spy's raw stacks of busy threads (taken without --idle) made into milliseconds per request: each part's
    share of the event loop thread's busy samples times that thread's CPU per request over the same window."""
    parts: dict[str, int] = dict.fromkeys(PARTS, 0)
    own: dict[str, int] = defaultdict(int)
    busy = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count, frames = int(count_text), stack.split(";")
        if frames[0].split(": ", 1)[-1] != "MainThread":
            continue
        busy += count
        part = _part(frames)
        parts[part] += count
        if part == PARTS[3]:
            own[_own_step(frames)] += count
    per_sample = loop_ms / max(busy, 1)
    return {
        "requests": requests,
        "samples": busy,
        "loop_ms": round(loop_ms, 4),
        "other_threads_ms": round(other_ms, 4),
        "parts_ms": {k: round(c * per_sample, 4) for k, c in parts.items()},
        "own_steps_ms": {k: round(c * per_sample, 4) for k, c in sorted(own.items(), key=lambda x: -x[1])},
    }


def costs_text(costs: dict[str, Any]) -> str:
    bare, served = costs["bare"], costs["stackpin-sqlite"]
    lines = [
        "| CPU per request, ms | bare | stackpin (SQLite) | difference |",
        "| --- | ---: | ---: | ---: |",
    ]
    rows = [(f"event loop: {name}", bare["parts_ms"][name], served["parts_ms"][name]) for name in PARTS]
    rows += [
        ("event loop, all", bare["loop_ms"], served["loop_ms"]),
        (
            "other threads (the audit writer's, the drivers')",
            bare["other_threads_ms"],
            served["other_threads_ms"],
        ),
        (
            "the process",
            bare["loop_ms"] + bare["other_threads_ms"],
            served["loop_ms"] + served["other_threads_ms"],
        ),
    ]
    lines += [f"| {name} | {b:.3f} | {s:.3f} | {s - b:+.3f} |" for name, b, s in rows]
    lines += ["", "| stackpin's own work on the event loop | ms per request |", "| --- | ---: |"]
    lines += [f"| {step} | {ms:.3f} |" for step, ms in served["own_steps_ms"].items()]
    return "\n".join(lines)


def _steal(share: float | None) -> str:
    return "" if share is None else f"CPU time taken by the virtual machine's host (steal) {share:.1%}; "


def markdown(document: dict[str, Any]) -> str:
    run = document["run"]
    plan = run["plan"]
    m = run["machine"]
    parts = [
        "# What the proxy costs: straight, a bare aiohttp relay, and stackpin, side by side",
        "",
        "Written by the run:",
        "",
        f"```\n{run['command']}\n```",
        "",
        f"Commit `{run['commit']}`, {run['date']}; {m['cpu']}, {m['cores']} cores, Python {m['python']}; load "
        f"average before {run['load_average_before']}, after {run['load_average_after']}; "
        f"{_steal(run.get('steal_share'))}{run['seconds']} s.",
        "",
        f"{plan['rounds']} interleaved rounds (order rotated, fresh processes each round): per relay "
        f"{plan['latency_requests']} requests one at a time, {plan['requests']} at {plan['concurrency']} "
        f"closed-loop clients, {plan['stream_requests']} streams one at a time (time to the first body byte), "
        f"each phase after {plan['warmup']} warm-up requests. stackpin runs `stackpin serve` with a durable (`disk`) "
        f"store, logging at `{plan.get('log_level', 'warning')}`. CPU is the relay process's own (workers "
        "included; PostgreSQL's server processes not). *Over bare* is a relay's p50 at one client less the bare "
        "relay's; *of which commit* is stackpin's mean group commit over the same requests, from its own "
        "`stackpin_audit_commit_seconds` (planning the batch, the transaction, its callers told), which every "
        "answer waits for. Medians over rounds; ratios and differences are taken within each round, then their "
        "median.",
        *(f"\nNote: {note}" for note in run["notes"]),
        "",
        table(document),
        "",
        "Against the targets (issue 26):",
        "",
        targets_table(document),
        "",
        "Per round (stackpin against the bare relay):",
        "",
        rounds_table(document),
    ]
    if document.get("profile"):
        parts += [
            "",
            f"## Where the CPU goes (py-spy, {plan['concurrency']} clients, bare relay and stackpin on SQLite)",
            "",
            "Each relay in turn under the same closed-loop load, py-spy sampling its busy threads (200 Hz, no "
            "`--idle`) while /proc counts its CPU. A part's milliseconds per request are its share of the event "
            "loop thread's busy samples times that thread's CPU per request in the same window. Parts are judged "
            "by the whole stack: library code (aiohttp, multidict, yarl) under aiohttp's client is the client, "
            "other library code the server; uvloop's C and asyncio's Python are the event loop; the rest is the "
            "relay's own work, by the first of its steps found in the stack.",
            "",
            costs_text(document["profile"]),
        ]
    return "\n".join(parts) + "\n"
