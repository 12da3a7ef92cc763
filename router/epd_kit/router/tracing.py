"""OpenTelemetry traces of the chat requests (docs/router.md "Tracing").

On only when router.yaml names a collector (`tracing.otlp_traces_endpoint`). A sampled chat
request (`sample_ratio`, drawn by the router: a client's flags never force it) is then one span
tree, exported in batches over OTLP/HTTP (protobuf) by the SDK's background thread from a queue of
QUEUE_SPANS spans (more are dropped and counted): a collector that is down or never answers costs
spans, never a request, and at most SHUTDOWN_S of a process's exit:

    POST /v1/chat/completions   SERVER: from the request's arrival to its last byte
      receive                   the body read and decoded
      render                    chat template, tokens, images fetched and preprocessed
      ve encode                 CLIENT: one per VE call
      pd generate               CLIENT: one per PD call (a retry on another PD is another)
      stream                    the relay of a streamed answer to its client

A client's W3C `traceparent` (and `tracestate`) makes a sampled request's span its child: the
client's trace goes on. Its sampled flag decides nothing (any client could force full tracing):
an unsampled request passes the client's trace on to the engines with that flag cleared. With
`trust_parent_sampled` (off by default; a fleet behind a gateway that samples, whose clients
cannot reach the router directly) the flag decides for a request that carries a valid
traceparent, as OpenTelemetry's ParentBased sampler does (opentelemetry-sdk trace/sampling.py
`ParentBased`: the parent's sampled flag, the root sampler only without a parent).
Invalid headers are counted (epd_router_trace_context_errors), never logged: a client writes
them. Each engine call carries a `traceparent` naming its own span; vLLM reads
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
import contextlib
import logging
import os
import random
import re
import socket
import threading
from collections.abc import Callable, Mapping
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.responses import Response

    from epd_kit.router.pools import Engine
    from epd_kit.router_yaml import Tracing as TracingSettings

SERVICE_NAME = "epd-router"
REQUEST_SPAN = "POST /v1/chat/completions"

# W3C Trace Context (www.w3.org/TR/trace-context/ §3.2): version 00, lower-case hex, ids not all
# zero. Any other value (another version, upper case, garbage, two traceparent headers) is ignored
# and a new trace starts, as the spec says for a traceparent that cannot be parsed; nothing else
# reaches an engine's head.
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
# tracestate (§3.3): several headers are combined into one list as RFC 7230 §3.2.2 says (joined
# with commas, in order); empty members are skipped; at most 32 members, each `key=value` of the
# spec's grammar, keys unique (as OpenTelemetry's TraceState also requires). A list that breaks a
# rule is dropped whole (the spec lets a vendor discard a tracestate it cannot parse), and so is
# one over the 512 characters the spec asks vendors to propagate at least ("tracestate Limits"):
# more is the client's payload, not ours to relay.
_TRACESTATE_KEY = re.compile(r"[a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13}")
_TRACESTATE_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
_TRACESTATE_MEMBERS = 32
_TRACESTATE_CHARS = 512

# the export queue (beyond it the SDK drops the oldest span: a bounded deque, opentelemetry-sdk
# 1.45 _shared_internal BatchProcessor.emit; memory bounded by spans, each by the SDK's default
# span limits) and the batch the export thread sends at once
QUEUE_SPANS = 2048
BATCH_SPANS = 512
# an export call's own deadline (the exporter retries within it: opentelemetry exporter/otlp/
# common/http.py `export`, 0.66b2; its default is 10 s), and how long a process's exit waits
# for the queue's last export before it drops the rest: a collector that accepts and never
# answers must not hold a restart (the unit's stop timeout) hostage
EXPORT_TIMEOUT_S = 5.0
SHUTDOWN_S = 2.0

# the trace header lines (each ending CRLF) of the engine call running in this context
_engine_headers: ContextVar[bytes] = ContextVar("epd_engine_trace_headers", default=b"")
# the traced request running in this context
_current: ContextVar[RequestTrace | None] = ContextVar("epd_request_trace", default=None)


def engine_headers() -> bytes:
    """The trace header lines the current engine call sends (b'' for none): engine_http.py."""
    return _engine_headers.get()


def _header_values(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of a header (Starlette's Headers keep repeats; a plain dict has one)."""
    getlist = getattr(headers, "getlist", None)
    if getlist is not None:
        return getlist(name)
    value = headers.get(name)
    return [] if value is None else [value]


def parse_tracestate(values: list[str]) -> list[tuple[str, str]] | None:
    """The members of a request's tracestate header(s), or None when they break a rule above."""
    combined = ",".join(values)
    if len(combined) > _TRACESTATE_CHARS * 2:  # bounded work before any split
        return None
    members: list[tuple[str, str]] = []
    keys: set[str] = set()
    for raw in combined.split(","):
        member = raw.strip(" \t")
        if not member:
            continue
        key, sep, value = member.partition("=")
        if not sep or key in keys or not _TRACESTATE_KEY.fullmatch(key) or not _TRACESTATE_VALUE.fullmatch(value):
            return None
        keys.add(key)
        members.append((key, value))
    if len(members) > _TRACESTATE_MEMBERS or len(",".join(f"{k}={v}" for k, v in members)) > _TRACESTATE_CHARS:
        return None
    return members


def _header_lines(traceparent: str, tracestate: str | None) -> bytes:
    lines = f"traceparent: {traceparent}\r\n"
    if tracestate:
        lines += f"tracestate: {tracestate}\r\n"
    return lines.encode("ascii")


def _unsampled(traceparent: str) -> str:
    """The client's traceparent with its sampled flag (bit 0, §3.2.2.5) cleared."""
    flags = int(traceparent[-2:], 16) & ~1
    return f"{traceparent[:-2]}{flags:02x}"


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


def _no_count(header: str) -> None:
    return None


class Tracing:
    """The router process's tracer: off (`enabled` False) unless settings name a collector.
    `invalid(header)` counts a client's trace header ignored as invalid; `dropped()` a span the
    full export queue dropped (RouterMetrics)."""

    def __init__(
        self,
        settings: TracingSettings,
        invalid: Callable[[str], None] = _no_count,
        dropped: Callable[[], None] | None = None,
    ) -> None:
        self._provider: Any = None
        self._tracer: Any = None
        self._invalid = invalid
        self._ratio = settings.sample_ratio
        self._trust_parent = settings.trust_parent_sampled
        self._log_filter: _ExportLogs | None = None
        if settings.otlp_traces_endpoint is not None:
            self._provider, self._tracer = _sdk_tracer(settings)
            self._log_filter = _ExportLogs.install(dropped)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def client_context(self, headers: Mapping[str, str]) -> tuple[str | None, list[tuple[str, str]]]:
        """The client's valid traceparent (None: none, or invalid) and its tracestate's members
        (empty when it has none or an invalid one: a valid traceparent stands without it)."""
        parents = _header_values(headers, "traceparent")
        if not parents:
            return None, []
        if len(parents) > 1 or not _TRACEPARENT.fullmatch(parents[0]):
            self._invalid("traceparent")
            return None, []
        states = _header_values(headers, "tracestate")
        if not states:
            return parents[0], []
        members = parse_tracestate(states)
        if members is None:
            self._invalid("tracestate")
            return parents[0], []
        return parents[0], members

    def begin(self, headers: Mapping[str, str]) -> RequestTrace | Token[bytes] | None:
        """A chat request arrives with `headers`; what `finish` takes when it is over. Not traced
        (off, or not sampled): the client's valid traceparent is what its engine calls carry,
        unchanged when off, with its sampled flag cleared when the router chose not to sample."""
        parent, state = self.client_context(headers)
        if self._tracer is not None:
            if self._sampled(parent):
                return RequestTrace(self._tracer, parent, state)
            if parent is not None:
                parent = _unsampled(parent)
        if parent is None:
            return None
        tracestate = ",".join(f"{k}={v}" for k, v in state)
        return _engine_headers.set(_header_lines(parent, tracestate))

    def _sampled(self, parent: str | None) -> bool:
        """The router's draw; with trust_parent_sampled, a valid parent's sampled flag instead
        (bit 0 of trace-flags, W3C Trace Context §3.2.2.5)."""
        if self._trust_parent and parent is not None:
            return bool(int(parent[-2:], 16) & 1)
        return self._ratio >= 1.0 or random.random() < self._ratio

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
        """Export what is queued within SHUTDOWN_S, then leave the rest: the shutdown runs in a
        daemon thread (asyncio.to_thread's pool is joined at exit, which would wait for a
        collector that never answers), as the SDK's export thread is."""
        if self._provider is None:
            return
        provider, self._provider, self._tracer = self._provider, None, None
        done = asyncio.get_running_loop().create_future()

        def shutdown() -> None:
            try:
                provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    done.get_loop().call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        threading.Thread(target=shutdown, name="epd-trace-shutdown", daemon=True).start()
        try:
            async with asyncio.timeout(SHUTDOWN_S):
                await done
        except TimeoutError:
            logging.getLogger("epd_router.tracing").warning(
                "the trace collector did not take the last spans in time: dropped",
                extra={"wait_s": SHUTDOWN_S},
            )
        if self._log_filter is not None:
            self._log_filter.remove()


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

    def __init__(self, tracer: Any, traceparent: str | None, tracestate: list[tuple[str, str]]) -> None:
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, set_span_in_context
        from opentelemetry.trace.span import TraceState

        client = None
        if traceparent is not None:  # validated by Tracing.client_context: no propagator re-parse
            _, trace_id, span_id, flags = traceparent.split("-")
            context = SpanContext(
                int(trace_id, 16),
                int(span_id, 16),
                is_remote=True,
                trace_flags=TraceFlags(int(flags, 16)),
                trace_state=TraceState(tracestate),
            )
            client = set_span_in_context(NonRecordingSpan(context))
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
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    resource = Resource.create(
        {"service.name": SERVICE_NAME, "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"}
    )
    # ALWAYS_ON: Tracing.begin has sampled already (the router's own draw, not the client's trace
    # id or flags, which a TraceIdRatioBased/ParentBased sampler would follow). No atexit
    # shutdown: aclose bounds it, an atexit one would wait for the collector again.
    provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
    exporter = OTLPSpanExporter(endpoint=settings.otlp_traces_endpoint, timeout=EXPORT_TIMEOUT_S)
    provider.add_span_processor(
        BatchSpanProcessor(exporter, max_queue_size=QUEUE_SPANS, max_export_batch_size=BATCH_SPANS)
    )
    return provider, provider.get_tracer("epd_kit.router")


class _ExportLogs(logging.Handler):
    """The SDK's own log lines (plain text, outside the router's JSON log): a full queue's
    per-span "Queue full" warning becomes a count; the rest (a failed export, once a batch) goes
    to the router's log. Installed on the "opentelemetry" logger, which stops propagating."""

    _LOGGER = "opentelemetry"

    def __init__(self, dropped: Callable[[], None] | None) -> None:
        super().__init__()
        self._dropped = dropped
        self._log = logging.getLogger("epd_router.tracing")
        self._propagate = True

    @classmethod
    def install(cls, dropped: Callable[[], None] | None) -> _ExportLogs:
        handler = cls(dropped)
        logger = logging.getLogger(cls._LOGGER)
        handler._propagate, logger.propagate = logger.propagate, False
        logger.addHandler(handler)
        return handler

    def remove(self) -> None:
        logger = logging.getLogger(self._LOGGER)
        logger.removeHandler(self)
        logger.propagate = self._propagate

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Queue full"):
            if self._dropped is not None:
                self._dropped()
            return
        self._log.log(record.levelno, "trace export: %s", message)
