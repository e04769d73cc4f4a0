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
        f"| relay | p50 / p99 ms, 1 client | added p50 / p99 ms | req/s, {concurrency} clients | x straight | x bare "
        f"| CPU ms/req, 1 / {concurrency} | of which event loop, {concurrency} | CPU x bare, 1 / {concurrency} "
        "| stream TTFB ms | TTFB - bare ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, figures in document["summary"].items():
        m = figures["median"]
        lines.append(
            f"| {name} | {_f(m['p50_ms'])} / {_f(m['p99_ms'])} | {_f(m.get('added_p50_ms'))} / "
            f"{_f(m.get('added_p99_ms'))} | {_f(m['rps'], 0)} | {_f(m.get('rps_vs_straight'), 3)} | "
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

# Where a sampled frame's time goes, by the file it runs in (first match wins; `self` time of the leaf frame).
CATEGORIES = (
    ("canonical JSON (rfc8785)", ("rfc8785",)),
    ("stdlib json / orjson", ("json/", "orjson")),
    ("pydantic", ("pydantic",)),
    ("SQLAlchemy", ("sqlalchemy",)),
    ("sqlite3 / aiosqlite", ("sqlite3", "aiosqlite")),
    ("asyncpg", ("asyncpg",)),
    ("aiohttp: socket writes", ("http_writer.py:116", "selector_events.py:1057")),
    ("aiohttp client", ("aiohttp/client", "aiohttp/connector", "aiohttp/streams", "aiohttp/tracing")),
    ("aiohttp server", ("aiohttp/web", "aiohttp/http_", "aiohttp/_http", "aiohttp/base_protocol")),
    ("aiohttp other", ("aiohttp/", "multidict", "yarl")),
    ("logging (structlog)", ("structlog", "logging/")),
    ("metrics (prometheus_client)", ("prometheus_client",)),
    ("audit entries and commit hand-off (proxy/audit)", ("proxy/audit/",)),
    ("proxy, other", ("proxy/",)),
    ("thread hand-offs (executor submit)", ("concurrent/futures",)),
    ("asyncio (Python)", ("asyncio/",)),
)
# A leaf frame in the loop's own run call: uvloop's C loop, whose idle wait and own work py-spy cannot tell apart.
LOOP_ITSELF = ("Runner.run (", "run_until_complete (", "run_forever (")
# The proxy's steps, inclusive of what they call.
STEPS = ("openai_route", "read_body", "read_request", "Proxy._dispatch", "post_json", "Proxy._entry",
         "AuditStore.append", "GroupCommitter._run", "_observe", "Proxy.answer_response",
         "RequestHandler.finish_response", "RequestHandler.data_received", "ResponseHandler.data_received")  # fmt: skip
IDLE_THREAD_LEAVES = ("_worker (", "_connection_worker_thread (", "wait (", "get (")


def _category(frames: list[str]) -> str:
    leaf = frames[-1]
    if len(frames) == 1 or any(leaf.startswith(name) for name in LOOP_ITSELF):
        return "event loop itself (uvloop: idle and its own C work)"
    if "selectors.py" in leaf:
        return "idle (waiting in select)"
    for name, needles in CATEGORIES:
        if any(needle in leaf for needle in needles):
            return name
    return "other (stdlib, hashlib, os, ...)"


def profile_shares(raw: str) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks, taken with --idle, summed into shares of the event loop thread's time: by
    where the leaf frame runs, and by the proxy's steps (inclusive); and each other thread's busy share."""
    leaf: dict[str, int] = defaultdict(int)
    inclusive: dict[str, int] = defaultdict(int)
    threads: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name: [busy, all]
    loop_total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count, frames = int(count_text), stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        if thread != "MainThread":
            idle = len(frames) == 1 or frames[-1].startswith(IDLE_THREAD_LEAVES)
            threads[thread][0] += 0 if idle else count
            threads[thread][1] += count
            continue
        loop_total += count
        leaf[_category(frames)] += count
        functions = {frame.split(" (", 1)[0] for frame in frames[1:]}
        for step in STEPS:
            if step in functions:
                inclusive[step] += count
    total = loop_total or 1
    return {
        "samples": loop_total,
        "event_loop_self": {k: round(c / total, 4) for k, c in sorted(leaf.items(), key=lambda x: -x[1])},
        "event_loop_inclusive": {
            k: round(c / total, 4) for k, c in sorted(inclusive.items(), key=lambda x: -x[1])
        },
        "other_threads_busy": {t: round(busy / max(n, 1), 4) for t, (busy, n) in threads.items()},
    }


def profile_text(profile: dict[str, Any]) -> str:
    lines = ["| where (event loop thread, self time) | share |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.1%} |" for k, v in profile["event_loop_self"].items()]
    lines += ["", "| step (event loop thread, inclusive) | share |", "| --- | ---: |"]
    lines += [f"| `{k}` | {v:.1%} |" for k, v in profile["event_loop_inclusive"].items()]
    lines += ["", "| other thread | busy share of its time |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.1%} |" for k, v in profile["other_threads_busy"].items()]
    return "\n".join(lines)


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
        f"average before {run['load_average_before']}, after {run['load_average_after']}; {run['seconds']} s.",
        "",
        f"{plan['rounds']} interleaved rounds (order rotated, fresh processes each round): per relay "
        f"{plan['latency_requests']} requests one at a time, {plan['requests']} at {plan['concurrency']} "
        f"closed-loop clients, {plan['stream_requests']} streams one at a time (time to the first body byte), "
        f"each phase after {plan['warmup']} warm-up requests. stackpin runs `stackpin serve` with a durable (`disk`) "
        f"store, logging at `{plan.get('log_level', 'warning')}`. CPU is the relay process's own (workers included; PostgreSQL's server processes not). Medians over "
        "rounds; ratios and differences are taken within each round, then their median.",
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
            f"## Where stackpin's time goes (py-spy, SQLite, {plan['concurrency']} clients)",
            "",
            "py-spy (`--idle`, 200 Hz) over the stackpin process while the clients load it. Shares are of the "
            "event loop thread's samples: by where the leaf frame runs (self), and by the proxy's steps "
            "(inclusive, they overlap). On a loaded machine a thread preempted at a system call is sampled there, "
            "so system calls (socket writes, waking the writer thread, os.urandom) read larger than their CPU cost.",
            "",
            profile_text(document["profile"]),
        ]
    return "\n".join(parts) + "\n"
