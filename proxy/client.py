"""The CLI's HTTP side: `replay` and `probe` talk to a running proxy, as any client would."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from typing import Any

import aiohttp

from proxy.pins import parse_pin_header

EXIT_OK, EXIT_DIVERGED, EXIT_ERROR = 0, 1, 2


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def replay(target: tuple[str, str | None], record_id: str, *, on: str | None, as_json: bool) -> int:
    url, api_key = target
    body: dict[str, Any] = {}
    if on:
        body["on"] = parse_pin_header(on).model_dump(exclude_none=True)
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{url}/v1/records/{record_id}/replay", json=body, headers=_headers(api_key)
            ) as response,
        ):
            result = await response.json(content_type=None)
            status = response.status
    except aiohttp.ClientError as e:
        print(f"stackpin: cannot reach the proxy at {url}: {e}", file=sys.stderr)
        return EXIT_ERROR
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
    if status != 200:
        if not as_json:
            _print_error(result)
        return EXIT_ERROR
    if not as_json:
        _print_replay(result)
    return EXIT_OK if result.get("outcome") == "reproduced" else EXIT_DIVERGED


def _print_error(result: Any) -> None:
    error = result.get("error", {}) if isinstance(result, dict) else {}
    print(f"error: {error.get('message', result)}", file=sys.stderr)
    if "live_stacks" in error and not error["live_stacks"]:
        print("  no stack is live", file=sys.stderr)
    for stack in error.get("live_stacks", []):
        s = stack["stack"]
        print(
            f"  live: {stack['short']}  model={s['model']} quantisation={s['quantisation']} "
            f"hardware={s['hardware']} kernel_mode={s['kernel_mode']}  replicas={','.join(stack['replicas'])}",
            file=sys.stderr,
        )


def _print_replay(result: dict[str, Any]) -> None:
    print(f"{result['outcome']}: record {result['record']} replayed as {result['replay_record']}")
    print(f"  stack {result['stack']} (compared {result['compared']})")
    if result["outcome"] == "diverged":
        print(
            f"  first divergence at {'token' if result['compared'] == 'tokens' else 'character'} {result['position']}"
            f" ({result['reason']})"
        )
        if "original_logprob" in result:
            print(
                f"  logprob bits: original {result['original_logprob']}  replay {result['replayed_logprob']}"
            )
        if "original_ids" in result:
            print(f"  original ids: {result['original_ids']}")
            print(f"  replay ids:   {result['replayed_ids']}")
        print(f"  original: {result.get('original', '')!r}")
        print(f"  replay:   {result.get('replayed', '')!r}")


async def probe(target: tuple[str, str | None], args: argparse.Namespace) -> int:
    url, api_key = target
    headers = _headers(api_key)
    if args.pin:
        headers["Stackpin-Pin"] = args.pin
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    semaphore = asyncio.Semaphore(max(1, args.concurrency))
    answers: Counter[str] = Counter()  # by token ids (or text, from replicas that give no ids)
    bitwise: Counter[str] = Counter()  # by token ids and the bits of their logprobs
    failures: Counter[str] = Counter()
    stacks: set[str] = set()

    async def one(session: aiohttp.ClientSession) -> None:
        async with (
            semaphore,
            session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response,
        ):
            result = await response.json(content_type=None)
            if response.status != 200:
                failures[str(result.get("error", {}).get("message", response.status))] += 1
                return
            stacks.add(response.headers.get("Stackpin-Stack", "?"))
            extension = result.get("stackpin") or {}
            text = result["choices"][0]["message"]["content"]
            ids = extension.get("token_ids")
            key = json.dumps(ids) if ids is not None else text
            answers[key] += 1
            bits = [float(lp).hex() for lp in extension.get("token_logprobs") or []]
            bitwise[json.dumps([key, bits])] += 1

    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(one(session) for _ in range(args.requests)))
    except aiohttp.ClientError as e:
        print(f"stackpin: cannot reach the proxy at {url}: {e}", file=sys.stderr)
        return EXIT_ERROR
    summary = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "answered": sum(answers.values()),
        "distinct_completions": len(answers),
        "distinct_bitwise": len(bitwise),
        "largest_group": max(answers.values(), default=0),
        "stacks": sorted(stacks),
        "failures": dict(failures),
    }
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(
            f"{summary['answered']}/{args.requests} answered at concurrency {args.concurrency}: "
            f"{summary['distinct_completions']} distinct completion(s), {summary['distinct_bitwise']} distinct "
            f"counting logprob bits; stacks {', '.join(summary['stacks'])}"
        )
        for message, count in failures.items():
            print(f"  {count} failed: {message}")
    return EXIT_OK if not failures else EXIT_ERROR
