"""OpenTelemetry traces of the chat requests (docs/router.md "Tracing").

On only when router.yaml names a collector (`tracing.otlp_traces_endpoint`). Each chat request
is then one span tree, exported in batches over OTLP/HTTP (protobuf) by the SDK's background
thread (a collector that is down costs dropped spans and a logged warning, never a request):

    POST /v1/chat/completions   SERVER: from the request's arrival to its last byte
      receive                   the body read and decoded
      render                    chat template, tokens, images fetched and preprocessed
      ve encode                 CLIENT: one per VE call
      pd generate               CLIENT: one per PD call (a retry on another PD is another)
      stream                    the relay of a streamed answer to its client

A client's W3C `traceparent` (and `tracestate`) makes the request span its child: the client's
trace goes on. Each engine call carries a `traceparent` naming its own span; vLLM reads
`traceparent`/`tracestate` on its generate route when it exports spans itself
(`--otlp-traces-endpoint`; vllm/entrypoints/serve/disagg/serving.py `_get_trace_headers`,
vllm/tracing/utils.py TRACE_HEADERS, v0.24.0 and v0.29.0), so its `llm_request` span joins the
tree under the call that caused it.

Off, nothing of OpenTelemetry is imported or made: a request costs a header lookup, and a valid
client `traceparent` is passed on to the engines unchanged (their spans, when they export, still
join the client's trace). bench/router_overhead.py measures both (docs/benchmarks.md).

Spans name their parent explicitly (the request's span), never through OpenTelemetry's current
context: a stream's span ends in whichever task closes the response. The header an engine call
carries travels in a ContextVar that engine_http.py's request head reads (`engine_headers`).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import Mapping
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.responses import Response

    from epd_kit.router.config import Tracing as TracingSettings
    from epd_kit.router.pools import Engine

SERVICE_NAME = "epd-router"
REQUEST_SPAN = "POST /v1/chat/completions"

# W3C Trace Context (www.w3.org/TR/trace-context/ §3.2): version 00, lower-case hex, ids not all
# zero. Any other value (another version, upper case, garbage) is ignored and a new trace starts,
# as the spec says for a traceparent that cannot be parsed; nothing else reaches an engine's head.
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
# tracestate (§3.3): passed on only when it is printable ASCII within the spec's 512 characters
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")

# the trace header lines (each ending CRLF) of the engine call running in this context
_engine_headers: ContextVar[bytes] = ContextVar("epd_engine_trace_headers", default=b"")
# the traced request running in this context
_current: ContextVar[RequestTrace | None] = ContextVar("epd_request_trace", default=None)


def engine_headers() -> bytes:
    """The trace header lines the current engine call sends (b'' for none): engine_http.py."""
    return _engine_headers.get()


def valid_traceparent(value: str | None) -> bool:
    return value is not None and _TRACEPARENT.fullmatch(value) is not None


def _header_lines(traceparent: str, tracestate: str | None) -> bytes:
    lines = f"traceparent: {traceparent}\r\n"
    if tracestate and _TRACESTATE.fullmatch(tracestate):
        lines += f"tracestate: {tracestate}\r\n"
    return lines.encode("ascii")


class _NullSpan:
    """The span of a request that is not traced."""

    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def end(self, error: str | None = None) -> None:
        return None


NULL_SPAN = _NullSpan()


def span(name: str) -> _NullSpan | _Span:
    """A stage of the current request (`with tracing.span("render"):`); nothing when untraced."""
    trace = _current.get()
    return NULL_SPAN if trace is None else trace.child(name)


def engine_call(engine: Engine, name: str) -> _NullSpan | _Span:
    """One engine call of the current request: its span, and its traceparent on the call."""
    trace = _current.get()
    return NULL_SPAN if trace is None else trace.engine_call(engine, name)


class Tracing:
    """The router process's tracer: off (`enabled` False) unless settings name a collector."""

    def __init__(self, settings: TracingSettings) -> None:
        self._provider: Any = None
        self._tracer: Any = None
        if settings.otlp_traces_endpoint is not None:
            self._provider, self._tracer = _sdk_tracer(settings)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def begin(self, headers: Mapping[str, str]) -> RequestTrace | Token[bytes] | None:
        """A chat request arrives with `headers`; what `finish` takes when it is over. Off: the
        client's valid traceparent is what its engine calls carry."""
        parent = headers.get("traceparent")
        if self._tracer is None:
            if parent is None or not _TRACEPARENT.fullmatch(parent):
                return None
            return _engine_headers.set(_header_lines(parent, headers.get("tracestate")))
        return RequestTrace(self._tracer, parent if valid_traceparent(parent) else None, headers.get("tracestate"))

    @staticmethod
    def finish(handle: RequestTrace | Token[bytes] | None, response: Response | None) -> None:
        """The request's answer is over (its last byte sent, or the client gone); `response`
        None: the handler itself failed."""
        if handle is None:
            return
        if isinstance(handle, RequestTrace):
            if response is None:
                handle.end(500, None)
            else:
                handle.end(response.status_code, response.headers.get("x-request-id"))
        else:
            _engine_headers.reset(handle)

    async def aclose(self) -> None:
        """Export what is queued (up to the exporter's timeout) and stop the export thread."""
        if self._provider is not None:
            await asyncio.to_thread(self._provider.shutdown)
            self._provider = self._tracer = None


class _Span:
    """One span of a traced request, ended once (`end` or the `with` block's exit)."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def __enter__(self) -> _Span:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            self.end()
        elif issubclass(exc_type, asyncio.CancelledError):
            self.end("cancelled (the client left or the request's deadline passed)")
        else:
            self.end(getattr(exc, "message", None) or str(exc) or exc_type.__name__)

    def end(self, error: str | None = None) -> None:
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


class _EngineSpan(_Span):
    """An engine call's span: while it is open, the call carries its traceparent."""

    __slots__ = ("_token",)

    def __enter__(self) -> _EngineSpan:
        context = self._span.get_span_context()
        traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
        self._token = _engine_headers.set(_header_lines(traceparent, context.trace_state.to_header()))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        _engine_headers.reset(self._token)
        super().__exit__(exc_type, exc, tb)


class RequestTrace:
    """One traced chat request: its span, the parent of all its others."""

    __slots__ = ("_parent", "_span", "_token", "_tracer")

    def __init__(self, tracer: Any, traceparent: str | None, tracestate: str | None) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        client = None
        if traceparent is not None:
            carrier = {"traceparent": traceparent}
            if tracestate:
                carrier["tracestate"] = tracestate
            client = TraceContextTextMapPropagator().extract(carrier)
        self._tracer = tracer
        self._span = tracer.start_span(REQUEST_SPAN, context=client, kind=SpanKind.SERVER)
        self._parent = set_span_in_context(self._span)
        self._token = _current.set(self)

    def child(self, name: str) -> _Span:
        return _Span(self._tracer.start_span(name, context=self._parent))

    def engine_call(self, engine: Engine, name: str) -> _EngineSpan:
        from opentelemetry.trace import SpanKind

        attributes = {"epd.engine.id": engine.id, "epd.engine.role": engine.role, "server.address": engine.url}
        return _EngineSpan(
            self._tracer.start_span(name, context=self._parent, kind=SpanKind.CLIENT, attributes=attributes)
        )

    def end(self, status: int, request_id: str | None) -> None:
        _current.reset(self._token)
        self._span.set_attribute("http.response.status_code", status)
        if request_id is not None:
            self._span.set_attribute("epd.request_id", request_id)
        _Span(self._span).end(f"HTTP {status}" if status >= 500 else None)


def _sdk_tracer(settings: TracingSettings) -> tuple[Any, Any]:
    """The SDK's provider (batching exporter over OTLP/HTTP) and its tracer; this process's own,
    not OpenTelemetry's global one (two apps in one process share nothing)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create(
        {"service.name": SERVICE_NAME, "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"}
    )
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_traces_endpoint)))
    return provider, provider.get_tracer("epd_kit.router")
