"""OpenTelemetry: one span per answer, exported over OTLP/HTTP, so that Langfuse, Tempo or Jaeger show which stack
answered. Off unless `[telemetry] otlp_endpoint` is set; it needs the `otel` extra.

A span carries the GenAI semantic conventions (`gen_ai.operation.name`, `gen_ai.request.model`,
`gen_ai.response.model`, `gen_ai.usage.input_tokens`, ...) and stackpin's own attributes: the stack (fingerprint,
weights digest, quantisation, hardware, kernel mode, whether it was declared), the replica, the record and its
entry's place in the log (sequence number and leaf hash; its leaf index is not known yet when the answer is sent,
and `stackpin audit` or the record's proof gives it later). It spans the request from its arrival to its record's
commit. The SDK's batch processor exports from a thread of its own, so the request path only builds the span;
what goes into it is `answer_attributes`, a pure function. It never holds a prompt or an answer: those are the
record's, under the log's retention.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Protocol
from urllib.parse import urlsplit

import structlog

from proxy.audit import StoredEntry
from proxy.config import Secrets, TelemetrySettings
from proxy.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from proxy.errors import ConfigError
from proxy.serving.records import Served

try:  # the `otel` extra
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:  # pragma: no cover - the dev extra installs it
    OTLPSpanExporter = None

log = structlog.get_logger("stackpin.telemetry")
OPERATIONS = {CHAT: "chat", COMPLETIONS: "text_completion", EMBEDDINGS: "embeddings", RESPONSES: "chat"}
# The request's decoding settings under their GenAI names.
REQUEST_ATTRIBUTES = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "seed": "gen_ai.request.seed",
    "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "max_output_tokens": "gen_ai.request.max_tokens",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "n": "gen_ai.request.choice.count",
}


Body = Callable[[], dict[str, Any]]  # what the client got, made only if a span needs it


class Telemetry(Protocol):
    def answered(self, served: Served, body: Body, stored: StoredEntry, status: str) -> None:
        """An answer whose record is committed (`stored`, its entry, whose status is `status`)."""

    def shutdown(self) -> None:
        """Exports what is left; nothing is exported after."""


class NoTelemetry:
    """What the proxy has without `[telemetry] otlp_endpoint`: nothing, at no cost."""

    def answered(self, served: Served, body: Body, stored: StoredEntry, status: str) -> None:
        return None

    def shutdown(self) -> None:
        return None


def _usage(usage: Any) -> dict[str, int]:
    if not isinstance(usage, dict):
        return {}
    found = {}
    for name, keys in (
        ("gen_ai.usage.input_tokens", ("prompt_tokens", "input_tokens")),
        ("gen_ai.usage.output_tokens", ("completion_tokens", "output_tokens")),
    ):
        count = next((usage[k] for k in keys if isinstance(usage.get(k), int)), None)
        if count is not None:
            found[name] = count
    return found


def _finish_reasons(body: dict[str, Any]) -> list[str]:
    reasons = [c.get("finish_reason") for c in body.get("choices") or [] if isinstance(c, dict)]
    if isinstance(body.get("status"), str):  # a response's
        reasons.append(body["status"])
    return [r for r in reasons if isinstance(r, str)]


def answer_attributes(
    served: Served, body: dict[str, Any], stored: StoredEntry, status: str
) -> dict[str, Any]:
    """A span's attributes for one answer: the GenAI conventions' and stackpin's own. Pure."""
    request, stack = served.translated_from or served.forwarded, served.replica.stack
    replica_url = urlsplit(served.replica.url)
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": OPERATIONS.get(served.endpoint, "chat"),
        "gen_ai.provider.name": "stackpin",
        "gen_ai.request.model": request.get("model")
        if isinstance(request.get("model"), str)
        else stack.model,
        "server.address": replica_url.hostname or "",
        "stackpin.stack.fingerprint": served.fingerprint,
        "stackpin.stack.model": stack.model,
        "stackpin.stack.quantisation": stack.quantisation,
        "stackpin.stack.hardware": stack.hardware,
        "stackpin.stack.kernel_mode": stack.kernel_mode,
        "stackpin.stack.declared": served.replica.stack_source == "declared",
        "stackpin.stack.source": served.replica.stack_source.value,  # proven, reported or declared
        "stackpin.replica": served.replica.name,
        "stackpin.tenant": served.tenant,
        "stackpin.endpoint": served.endpoint,
        "stackpin.stream": stored.part != "answer",
        "stackpin.status": status,
        "stackpin.record.id": served.record_id,
        "stackpin.log.seq": stored.seq,
        "stackpin.log.leaf_hash": stored.leaf_hash,
    }
    if replica_url.port is not None:
        attributes["server.port"] = replica_url.port
    if stack.weights_sha256 is not None:
        attributes["stackpin.stack.weights_sha256"] = stack.weights_sha256
    if served.prompt is not None:
        attributes["stackpin.prompt"] = f"{served.prompt.name}@{served.prompt.version}"
    if served.replay_of is not None:
        attributes["stackpin.replay_of"] = served.replay_of
    for key, name in REQUEST_ATTRIBUTES.items():
        value = request.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attributes[name] = value
    stop = request.get("stop")
    if stop is not None:
        attributes["gen_ai.request.stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if isinstance(body.get("model"), str):
        attributes["gen_ai.response.model"] = body["model"]
    if isinstance(body.get("id"), str):
        attributes["gen_ai.response.id"] = body["id"]
    if reasons := _finish_reasons(body):
        attributes["gen_ai.response.finish_reasons"] = reasons
    return attributes | _usage(body.get("usage"))


def _nanoseconds(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000) * 1000


class OtlpTelemetry:
    """Spans over OTLP/HTTP (protobuf) to `settings.otlp_endpoint`, through the SDK's batch processor."""

    def __init__(
        self, settings: TelemetrySettings, headers: Mapping[str, str], clock: Callable[[], datetime]
    ) -> None:
        exporter = OTLPSpanExporter(
            endpoint=settings.otlp_endpoint, headers=dict(headers), timeout=settings.timeout_s
        )
        self._provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("stackpin")
        self._clock = clock

    def answered(self, served: Served, body: Body, stored: StoredEntry, status: str) -> None:
        # The answer is committed and about to be sent: a span that cannot be made must not stop it.
        try:
            self._span(served, body(), stored, status)
        except Exception:
            log.exception("telemetry_span_failed")

    def _span(self, served: Served, body: dict[str, Any], stored: StoredEntry, status: str) -> None:
        attributes = answer_attributes(served, body, stored, status)
        name = f"{attributes['gen_ai.operation.name']} {attributes['gen_ai.request.model']}"
        span = self._tracer.start_span(
            name, kind=SpanKind.CLIENT, attributes=attributes, start_time=_nanoseconds(served.received_at)
        )
        if status != "complete":
            span.set_attribute("error.type", status)
            span.set_status(Status(StatusCode.ERROR, f"the answer's record says {status}"))
        span.end(end_time=_nanoseconds(self._clock()))

    def flush(self) -> bool:
        return bool(self._provider.force_flush())

    def shutdown(self) -> None:
        self._provider.shutdown()


def telemetry_for(settings: TelemetrySettings, secrets: Secrets, clock: Callable[[], datetime]) -> Telemetry:
    """The proxy's telemetry: none without an OTLP endpoint."""
    if settings.otlp_endpoint is None:
        return NoTelemetry()
    if OTLPSpanExporter is None:
        raise ConfigError(
            "[telemetry] otlp_endpoint is set, but OpenTelemetry is not installed: pip install 'stackpin[otel]'"
        )
    return OtlpTelemetry(settings, _headers(secrets), clock)


def _headers(secrets: Secrets) -> dict[str, str]:
    """`k=v,k2=v2` (OTEL_EXPORTER_OTLP_HEADERS' form) from the variable `[telemetry] headers_env` names."""
    if secrets.otlp_headers is None:
        return {}
    pairs = [
        item.partition("=") for item in secrets.otlp_headers.get_secret_value().split(",") if item.strip()
    ]
    return {key.strip(): value.strip() for key, _, value in pairs}
