"""Structured JSON logs. Each request's task binds its record id, so every line about it carries that id.

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


def configure_logging(level: str, stream: TextIO = sys.stderr) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
