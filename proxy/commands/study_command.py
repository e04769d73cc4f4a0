"""`stackpin study PROMPTS`: a prompt set sent R times at each load level, against one pin or two, through a
running proxy; the divergence rate per prompt and over the set, with its spread, as JSON and an HTML report.

The study keeps its state in a folder (`--out`; by default one named for the study's plan, so that the same
command finds it again): `study.json` says which study it is and when it began, then holds the report; and
`report.html` is the report to open or send. Its answers are in the audit log: run the same command again after an
interruption and it reads what the log already holds (through `[store]`, as `stackpin records` does) and sends
only the rest; once every answer is in, it only reports.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp

from proxy.app import utc_now
from proxy.audit import AuditError, AuditStore
from proxy.canonical import canonical_json
from proxy.commands.progress import progress_on
from proxy.config import Settings
from proxy.errors import BadRequest, ConfigError
from proxy.evidence.probe import Reply
from proxy.evidence.prompt_set import Defaults, PromptSetError, read_prompt_set
from proxy.evidence.study import Load, Side, StudyPlan, new_study_id, remaining, valid_study_id
from proxy.evidence.study_log import read_study
from proxy.evidence.study_report import Shape, StudyTally, headline, study_report
from proxy.evidence.studying import StudyAborted, StudyRequest, run_study
from proxy.pins import parse_pin_header
from proxy.serving.request import TAG_HEADER
from proxy.ui.study_page import standalone_report

EXIT_OK, EXIT_ERROR = 0, 2
STATE, REPORT = "study.json", "report.html"
CLOCK_SLACK = timedelta(minutes=5)  # the proxy's clock may run behind this one's
REQUEST_TIMEOUT_S = 600
NO_SUCH_STACK = (
    "  no live stack matches that pin; to set the kernel modes side by side on the embedded default, serve both: "
    '[local_backend] kernel_modes = ["batch_invariant", "default"] in stackpin.toml'
)


def add_parser(commands: Any, client: argparse.ArgumentParser, default_model: str, run_command: Any) -> None:
    study = commands.add_parser(
        "study",
        parents=[client],
        help="send a prompt set R times at load levels, against one pin or two; report the divergence rate",
    )
    study.add_argument(
        "prompts", type=Path, help="a JSONL file of chat or completions requests, or text, one a line"
    )
    study.add_argument(
        "-n", "--repeats", type=int, default=10, help="times each prompt is sent per load (10)"
    )
    study.add_argument(
        "--load",
        action="append",
        metavar="C[+B]",
        help="a load level: C requests in flight, and B background clients sending random requests (repeatable; "
        "default 8+4)",
    )
    study.add_argument(
        "--pin", default="", help="the Stackpin-Pin to study, e.g. kernel_mode=batch_invariant"
    )
    study.add_argument("--compare", metavar="PIN", help="a second pin, studied side by side with the first")
    study.add_argument(
        "--model", default=default_model, help="for requests that name none (the embedded default's)"
    )
    study.add_argument("--max-tokens", type=int, default=32, help="for requests that set none (32)")
    study.add_argument("--temperature", type=float, default=0.0, help="for requests that set none (0)")
    study.add_argument("--seed", type=int, default=0, help="the background load's random seed (0)")
    study.add_argument("--out", type=Path, help="the study's folder (default: stackpin-study-<plan digest>)")
    study.add_argument("--fresh", action="store_true", help="start the study over, under a new id")
    study.add_argument("--json", action="store_true", help="print the report as JSON")
    study.set_defaults(run=run_command)


def plan_from(args: argparse.Namespace) -> StudyPlan:
    try:
        text = args.prompts.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"the prompt set {args.prompts} cannot be read: {e}") from e
    if args.repeats < 1 or args.max_tokens < 1:
        raise ConfigError("--repeats and --max-tokens must be at least 1")
    try:
        prompts = read_prompt_set(
            text, name=args.prompts.name, defaults=Defaults(args.model, args.max_tokens, args.temperature)
        )
        loads = [Load.parse(written) for written in (args.load or ["8+4"])]
        for pin in (args.pin, args.compare):
            if pin:
                parse_pin_header(pin)
    except (PromptSetError, ValueError) as e:
        raise ConfigError(str(e)) from e
    except BadRequest as e:
        raise ConfigError(e.message) from e
    sides = [Side("a", args.pin)] + ([Side("b", args.compare)] if args.compare is not None else [])
    try:
        # Its id is drawn when it starts, or read from its folder when it continues (`run`).
        return StudyPlan("st-000000000000", prompts, args.repeats, loads, sides, args.seed, args.prompts.name)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def folder_for(plan: StudyPlan, out: Path | None) -> Path:
    if out is not None:
        return out
    return Path(f"stackpin-study-{hashlib.sha256(canonical_json(plan.identity())).hexdigest()[:10]}")


def run(args: argparse.Namespace, settings: Settings, target: tuple[str, str | None]) -> int:
    plan = plan_from(args)
    folder = folder_for(plan, args.out)
    state = _state(folder, plan, fresh=args.fresh)
    plan = replace(plan, study=state["study"])
    started_at = datetime.fromisoformat(state["started_at"])
    tally = StudyTally()
    if state.get("begun"):  # its answers so far are in the log
        tally = asyncio.run(_from_log(settings, plan.study, started_at))
    _write(folder / STATE, {**state, "begun": True})
    try:
        asyncio.run(_send(plan, tally, target))
    except StudyAborted as e:
        print(f"stackpin: the study stopped: {e}", file=sys.stderr)
        if e.status == 409:
            print(NO_SUCH_STACK, file=sys.stderr)
        return EXIT_ERROR
    except aiohttp.ClientConnectorError as e:
        print(f"stackpin: cannot reach the proxy at {target[0]}: {e}", file=sys.stderr)
        return EXIT_ERROR
    return _report(args, plan, tally, folder, state, target[0])


def _state(folder: Path, plan: StudyPlan, *, fresh: bool) -> dict[str, Any]:
    """The study the folder holds (to continue), or a new one; another plan's folder is refused."""
    path = folder / STATE
    if path.is_file() and not fresh:
        try:
            held = json.loads(path.read_text(encoding="utf-8"))
            study, identity = held["study"], held["plan"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path} is not a study's state ({e}); remove it or pass --fresh") from e
        if not valid_study_id(study) or {k: identity.get(k) for k in plan.identity()} != plan.identity():
            raise ConfigError(
                f"{folder} holds another study (other prompts, repeats, loads, pins or seed): choose another "
                "--out, or pass --fresh to start this one there"
            )
        return held
    folder.mkdir(parents=True, exist_ok=True)
    study = new_study_id()
    plan_json = {**plan.as_json(), "study": study}
    return {"study": study, "started_at": utc_now().isoformat(), "plan": plan_json}


async def _from_log(settings: Settings, study: str, started_at: datetime) -> StudyTally:
    try:
        store = await AuditStore.open(settings.store.url, schema=settings.store.postgres_schema)
    except AuditError as e:
        raise ConfigError(
            f"continuing study {study} reads its answers from the audit store, which cannot be opened ({e}); "
            "point [store] url (--config) at the proxy's store, or pass --fresh"
        ) from e
    try:
        found = await read_study(store, study, since=started_at - CLOCK_SLACK)
    finally:
        await store.close()
    print(
        f"study {study}: {sum(found.tally.done().counts.values())} answers already in the log",
        file=sys.stderr,
    )
    return found.tally


async def _send(plan: StudyPlan, tally: StudyTally, target: tuple[str, str | None]) -> None:
    url, api_key = target
    total = sum(len(order) for _, _, order in remaining(plan, tally.done()))
    if total == 0:
        return
    most = max(load.concurrency + load.background for load in plan.loads)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=most + 1)
    progress = progress_on(sys.stderr, total, f"study {plan.study}")
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def send(request: StudyRequest) -> Reply:
            headers = {TAG_HEADER: request.tag}
            if request.pin:
                headers["Stackpin-Pin"] = request.pin
            if api_key:
                headers["Authorization"] = f"Bearer {api_key}"
            try:
                async with session.post(
                    url + request.endpoint, json=request.body, headers=headers
                ) as response:
                    return response.status, response.headers, await response.json(content_type=None)
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                return 599, {}, {"error": {"message": f"{type(e).__name__}: {e}"}}

        try:
            await run_study(
                plan, tally, send, lambda load, side: progress.advance(f"{load.label}, side {side.key}")
            )
        finally:
            progress.close()


def _report(
    args: argparse.Namespace,
    plan: StudyPlan,
    tally: StudyTally,
    folder: Path,
    state: dict[str, Any],
    url: str,
) -> int:
    done = tally.done().counts
    answered = sum(done.values())
    meta = {
        "study": plan.study,
        "plan": {**plan.as_json(), "requests": plan.requests},
        "started_at": state["started_at"],
        "reported_at": utc_now().isoformat(),
        "answered": answered,
        "complete": answered == plan.requests,
    }
    shape = Shape(plan.sides, plan.loads, {p.index: p.label for p in plan.prompts})
    report = study_report(tally, shape, meta)
    _write(folder / STATE, {**state, "begun": True, "report": report})
    (folder / REPORT).write_text(standalone_report(report, f"{url}/ui/records/"), encoding="utf-8")
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_summary(report, folder, url, state["started_at"])
    if not meta["complete"]:
        print(
            f"stackpin: {plan.requests - answered} of {plan.requests} requests have no answer yet; run the same "
            "command again to send them",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return EXIT_OK


def _print_summary(report: dict[str, Any], folder: Path, url: str, started_at: str) -> None:
    plan = report["plan"]
    print(
        f"study {report['study']}: {plan['prompt_count']} prompts x {plan['repeats']} repeats at "
        f"{', '.join(plan['loads'])}; {report['answered']}/{plan['requests']} answered"
    )
    for side in report["sides"]:
        print(f"  {headline(side)}")
        if len(side["loads"]) > 1:
            for load in side["loads"]:
                print(f"    at {load['load']}: {headline(side, load).split(': ', 1)[1]}")
        positions = side["overall"]["positions"]
        if positions["count"]:
            print(
                f"    first divergence at token {positions['first']} earliest, median {positions['median']}, "
                f"90% by {positions['p90']}"
            )
    since = (datetime.fromisoformat(started_at) - CLOCK_SLACK).isoformat()
    print(f"report: {folder / REPORT} (JSON: {folder / STATE})")
    print(f"audit page: {url}/ui/studies/{report['study']}?{urlencode({'since': since})}")


def _write(path: Path, value: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    partial.replace(path)
