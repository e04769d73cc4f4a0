"""Structured JSON logs. Each request's task binds its record id, so every line about it carries that id.

One format on the console: the proxy's own events (structlog), what libraries log through the standard
`logging` module (aiohttp, asyncio) and Python's warnings all become the same JSON lines, and the embedded
backend's output is relayed line by line as events too (proxy/replicas/local_backend.py).

Keys and bodies never reach a log line: handlers log ids, names, fingerprints and error messages only, and the
`redact` processor drops any event field whose name says it holds a secret.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

_SECRET_WORDS = ("key", "authorization", "token_secret", "password", "secret")


def redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for name in list(event):
        if any(word in name.lower() for word in _SECRET_WORDS):
            event[name] = "[redacted]"
    return event


class _JsonLines(logging.StreamHandler):  # type: ignore[type-arg]
    """The root logger's handler that configure_logging installs (and replaces when called again)."""


def configure_logging(level: str, stream: TextIO = sys.stderr) -> None:
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            redact,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        # One write per line, its newline included: print() writes the two apart, and on an unbuffered stderr
        # that processes share (a supervisor and its workers) another process's line lands between them.
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    handler = _JsonLines(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name, timestamper],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                redact,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _JsonLines)]:
        root.removeHandler(old)
    root.addHandler(handler)
    # Libraries' informational chatter (migrations' "Context impl SQLiteImpl.") only when debugging.
    root.setLevel(
        logging.DEBUG if level == "debug" else max(logging.WARNING, getattr(logging, level.upper()))
    )
    logging.captureWarnings(True)
