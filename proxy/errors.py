"""The proxy's errors: one small hierarchy, turned into OpenAI-style error bodies in exactly one place.

    StackpinError                  status, type, code, param, and a message that says what to fix
      BadRequest (400)             malformed JSON, wrong types, unknown pin keys, unknown prompt versions
      Unauthorized (401)           missing or unknown API key
      NotFound (404)               unknown route or record (also another tenant's record)
      PayloadTooLarge (413)        a body over `server.max_body_bytes`
      NoMatchingStack (409)        no known stack matches the pin
      NoLiveReplica (503)          stacks match the pin but none of their replicas is in rotation
      ReplicaFailed (502)          the replica failed, timed out or answered garbage; nothing was recorded
      RateLimited (429)            the tenant's requests or tokens per minute are used up; says when to retry

The OpenAI SDKs map these statuses to BadRequestError, AuthenticationError, NotFoundError,
ConflictError and InternalServerError.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web


class StackpinError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        error.update(self.extra)
        return {"error": error}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


class BadRequest(StackpinError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(StackpinError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(StackpinError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class PayloadTooLarge(StackpinError):
    status = 413
    type = "invalid_request_error"
    code = "body_too_large"


class NoMatchingStack(StackpinError):
    status = 409
    type = "no_matching_stack"
    code = "no_matching_stack"


class NoLiveReplica(StackpinError):
    status = 503
    type = "no_live_replica"
    code = "no_live_replica"


class ReplicaFailed(StackpinError):
    status = 502
    type = "replica_error"
    code = "replica_failed"


class RateLimited(StackpinError):
    """429 with an OpenAI-style body; `type` names the exhausted limit, as OpenAI's does."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.type = limit
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        return web.json_response(
            self.body(), status=self.status, headers={"Retry-After": str(self.retry_after_s)}
        )


class ConfigError(Exception):
    """The configuration cannot be used; the message names the file, key or variable to fix."""
