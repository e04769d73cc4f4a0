"""The proxy's errors: one small hierarchy, turned into OpenAI-style error bodies in exactly one place.

    StackpinError                  status, type, code, param, and a message that says what to fix
      BadRequest (400)             malformed JSON, wrong types, unknown pin keys, unknown prompt versions
      Unauthorized (401)           missing or unknown API key
      NotFound (404)               unknown route or record (also another tenant's record)
      RequestTimeout (408)         a body that did not arrive within `server.body_timeout_s`
      PayloadTooLarge (413)        a body over `server.max_body_bytes`
      PayloadErased (410)          a record whose request and answer were erased: there is nothing to replay
      NoMatchingStack (409)        no known stack matches the pin
        ModelNotFound (404)        the pin's model is no known stack's model (OpenAI's `model_not_found`)
      NoLiveReplica (503)          stacks match the pin but none of their replicas is in rotation
      ReplicaFailed (502)          the replica failed, timed out or answered garbage; nothing was recorded
        ReplicaUnavailable         unreachable, timed out or a 5xx: worth a retry on a twin of the same fingerprint
        ReplicaGarbage             an answer that is not what the OpenAI wire format promises
        StackMismatch              an answer from another stack than the replica described (its kind judges)
      ReplicaRejected (4xx)        the replica refused the request as the client's fault: its status and error
                                   body, relayed in OpenAI's shape
      RateLimited (429)            the tenant's requests or tokens per minute are used up; says when to retry
      AuditStoreUnavailable (503)  the audit store cannot commit or read now, so nothing is served; retry soon
      AtCapacity (503)             the proxy holds `server.max_connections` connections; only probes are answered

The replica's errors are raised by the transport (proxy/replicas/forward.py) and by dispatch (proxy/serving/dispatch.py); those
that dispatch does not retry reach the middleware like any other. A `retry_after_s` becomes a `Retry-After`
header; `close_connection` closes the connection after the answer.

The OpenAI SDKs map these statuses to BadRequestError, AuthenticationError, NotFoundError,
ConflictError and InternalServerError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from proxy.replicas.registry import ReplicaSnapshot


class StackpinError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None
    retry_after_s: int | None = None
    close_connection = False

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

    def response(self, body: dict[str, Any] | None = None) -> web.Response:
        """The answer; `body` replaces `self.body()` (the caller's redacted copy of it)."""
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        response = web.json_response(
            self.body() if body is None else body, status=self.status, headers=headers
        )
        if self.close_connection:
            response.force_close()
        return response


class HttpError(StackpinError):
    """A refusal made by HTTP itself (404 unknown path, 405 method, a header line over aiohttp's limit)."""

    type = "invalid_request_error"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = str(status)
        if status >= 500:
            self.type = "server_error"


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


class RequestTimeout(StackpinError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    close_connection = True  # the rest of the body may still be on its way


class PayloadTooLarge(StackpinError):
    status = 413
    type = "invalid_request_error"
    code = "body_too_large"


class PayloadErased(StackpinError):
    status = 410
    type = "invalid_request_error"
    code = "payload_erased"


class NoMatchingStack(StackpinError):
    status = 409
    type = "no_matching_stack"
    code = "no_matching_stack"


class ModelNotFound(NoMatchingStack):
    """What OpenAI answers for a model that does not exist, so that SDKs raise their NotFoundError."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NoLiveReplica(StackpinError):
    status = 503
    type = "no_live_replica"
    code = "no_live_replica"


class ReplicaFailed(StackpinError):
    status = 502
    type = "replica_error"
    code = "replica_failed"


class ReplicaUnavailable(ReplicaFailed):
    """Worth retrying on another replica of the identical fingerprint.

    `down` says the replica could not be reached at all (connection refused or reset, timeout): a replica that
    proves its stack leaves rotation until the health monitor reaches it again. A replica that answered, even with
    a 5xx, stays in, and so does a declared upstream, which no health check reaches.
    """

    def __init__(self, message: str, *, down: bool = True) -> None:
        super().__init__(message)
        self.down = down


class ReplicaGarbage(ReplicaFailed):
    """The replica answered something that is not an OpenAI response. `problem` (and `str()`) says what is wrong
    with it, as a stream's record and the logs say it; the client's `message` says whose fault it is too."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.message = f"the replica answered something that is not an OpenAI response: {problem}"


class StackMismatch(ReplicaFailed):
    """The answer came from another stack than the replica proved."""

    def __init__(self, replica: ReplicaSnapshot, claimed: str | None) -> None:
        super().__init__(
            f"replica {replica.name} answered as stack {claimed}, registered {replica.fingerprint}"
        )
        self.replica = replica
        self.claimed = claimed


class ReplicaRejected(StackpinError):
    """A 4xx from the replica: the client's request is at fault, and the client gets the replica's status and
    error body (in OpenAI's shape, secrets redacted by the middleware like every body)."""

    type = "replica_rejected"  # the label it is counted under; the body keeps the replica's own type

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"replica rejected the request with {status}")
        self.status = status
        self.replica_body = body

    def body(self) -> dict[str, Any]:
        return relayed_error(self.replica_body)


def relayed_error(body: dict[str, Any]) -> dict[str, Any]:
    """A replica's error body in OpenAI's shape (message, type, param, code), whatever else it held."""
    error = body.get("error") if isinstance(body.get("error"), dict) else {}
    message, kind = error.get("message"), error.get("type")
    return {
        "error": {
            "message": message if isinstance(message, str) else "the replica refused the request",
            "type": kind if isinstance(kind, str) else "replica_error",
            "param": error.get("param") if isinstance(error.get("param"), str) else None,
            "code": error.get("code") if isinstance(error.get("code"), str | int) else None,
        }
    }


class RateLimited(StackpinError):
    """429 with an OpenAI-style body; `type` names the exhausted limit, as OpenAI's does."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.type = limit
        self.retry_after_s = retry_after_s


class AuditStoreUnavailable(StackpinError):
    """No answer is served without its record (invariant 1), so while the store is away nothing is served."""

    status = 503
    type = "audit_store_unavailable"
    code = "audit_store_unavailable"
    retry_after_s = 1


class AtCapacity(StackpinError):
    status = 503
    type = "too_many_connections"
    code = "too_many_connections"
    retry_after_s = 1
    close_connection = True


class ConfigError(Exception):
    """The configuration cannot be used; the message names the file, key or variable to fix."""
