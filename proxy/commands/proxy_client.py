"""The CLI's HTTP side: `replay` and `probe` talk to a running proxy, as any client would."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import aiohttp

from proxy.evidence.compare import where
from proxy.evidence.probe import Reply, probe_body, run_probe
from proxy.pins import parse_pin_header

EXIT_OK, EXIT_DIVERGED, EXIT_ERROR = 0, 1, 2


def auth_headers(api_key: str | None) -> dict[str, str]:
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
                f"{url}/v1/records/{record_id}/replay", json=body, headers=auth_headers(api_key)
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
        print(f"  first divergence at {where(result)} ({result['reason']})")
        for kind in ("logprob", "bits"):
            if f"original_{kind}" in result:
                print(f"  {kind}: original {result[f'original_{kind}']}  replay {result[f'replayed_{kind}']}")
        if "original_ids" in result:
            print(f"  original ids: {result['original_ids']}")
            print(f"  replay ids:   {result['replayed_ids']}")
        print(f"  original: {result.get('original', '')!r}")
        print(f"  replay:   {result.get('replayed', '')!r}")


async def probe(target: tuple[str, str | None], args: argparse.Namespace) -> int:
    url, api_key = target
    headers = auth_headers(api_key)
    if args.pin:
        headers["Stackpin-Pin"] = args.pin
    body = probe_body(args.model, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature)

    async def send(session: aiohttp.ClientSession) -> Reply:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            return response.status, response.headers, await response.json(content_type=None)

    try:
        async with aiohttp.ClientSession() as session:
            result = await run_probe(
                lambda: send(session), requests=args.requests, concurrency=args.concurrency
            )
    except aiohttp.ClientError as e:
        print(f"stackpin: cannot reach the proxy at {url}: {e}", file=sys.stderr)
        return EXIT_ERROR
    summary = result.summary()
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(
            f"{summary['answered']}/{args.requests} answered at concurrency {args.concurrency}: "
            f"{summary['distinct_completions']} distinct completion(s), {summary['distinct_bitwise']} distinct "
            f"counting logprob bits; stacks {', '.join(summary['stacks'])}"
        )
        for variant in result.variants[1:]:
            print(
                f"  {variant.count} diverged from the most common answer at "
                f"{'token' if variant.tokens.token_ids is not None else 'character'} {variant.diverges_at} "
                f"({variant.reason})"
            )
        for message, count in result.failures.items():
            print(f"  {count} failed: {message}")
    return EXIT_OK if not result.failures else EXIT_ERROR
