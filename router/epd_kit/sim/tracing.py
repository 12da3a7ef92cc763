"""`--otlp-traces-endpoint` as vLLM reads it (v0.24.0 and v0.29.0, the same code in both):

- the flag names the collector; unset, tracing is off, and a request that carries a trace
  context is served as any other, with one warning for the engine's life ("Received a request
  with trace context but tracing is disabled": vllm/tracing/utils.py, `@run_once`);
- the exporter's protocol is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, "grpc" when unset, or
  "http/protobuf" (the flag is then the full traces URL); any other value is refused
  (vllm/tracing/otel.py `get_span_exporter`);
- the span of a request is `llm_request`, kind SERVER, child of the context its
  `traceparent`/`tracestate` headers carry (vllm/entrypoints/serve/disagg/serving.py
  `_get_trace_headers`, vllm/v1/engine/output_processor.py `do_tracing`), from its arrival to
  its end, with its request id (`gen_ai.request.id`);
- the resource is the SDK's default (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) plus
  `vllm.instrumenting_module_name` and `vllm.process_id` (vllm/tracing/otel.py
  `init_otel_tracer`).

One difference: the sim ships the OTLP/HTTP exporter only (the kit's own dependency); "grpc"
needs opentelemetry-exporter-otlp-proto-grpc, which vLLM requires and the kit does not, and is
refused at start with that said when it is missing. The kit's engine units set http/protobuf.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

log = logging.getLogger("epd_sim.tracing")

PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
MODULE_NAME = "vllm.llm_engine"  # vllm/v1/engine/async_llm.py init_tracer's

Handler = Callable[[Request], Awaitable[Response]]


class SimTracer:
    """The engine's tracer: one `llm_request` span per generate request."""

    def __init__(self, endpoint: str, env: Mapping[str, str]) -> None:
        """Raises ValueError with vLLM's message for a protocol it refuses, or the sim's for
        grpc without its exporter."""
        exporter = _exporter(endpoint, env.get(PROTOCOL_VARIABLE, "grpc"))
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"vllm.instrumenting_module_name": MODULE_NAME, "vllm.process_id": str(os.getpid())})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer(MODULE_NAME)

    def shutdown(self) -> None:
        self._provider.shutdown()

    def traced(self, handler: Handler) -> Handler:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        propagator = TraceContextTextMapPropagator()

        async def generate(request: Request) -> Response:
            arrival = time.time_ns()
            parent = propagator.extract({h: request.headers[h] for h in TRACE_HEADERS if h in request.headers})
            request_id = _request_id(await request.body())  # Starlette keeps the body for the handler
            response = await handler(request)
            span = self._tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER, start_time=arrival)
            if request_id:
                span.set_attribute("gen_ai.request.id", request_id)
            span.set_attribute("http.response.status_code", response.status_code)
            if not isinstance(response, StreamingResponse):
                span.end()
                return response
            response.body_iterator = _ending(response.body_iterator, span)
            return response

        return generate


async def _ending(body: AsyncIterator[Any], span: Any) -> AsyncIterator[Any]:
    """A stream's body, ending `span` with it (done, failed or abandoned)."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        span.end()


def _request_id(raw: bytes) -> str | None:
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    request_id = doc.get("request_id") if isinstance(doc, dict) else None
    return request_id if isinstance(request_id, str) else None


def untraced(handler: Handler) -> Handler:
    """Tracing off: as vLLM, a trace context on a request is warned about once."""
    warned = False

    async def generate(request: Request) -> Response:
        nonlocal warned
        if not warned and any(h in request.headers for h in TRACE_HEADERS):
            warned = True
            log.warning("Received a request with trace context but tracing is disabled")
        return await handler(request)

    return generate


def _exporter(endpoint: str, protocol: str) -> Any:
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    if protocol != "grpc":
        raise ValueError(f"Unsupported OTLP protocol '{protocol}' is configured")
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
            OTLPSpanExporter as GrpcExporter,
        )
    except ImportError:
        raise ValueError(
            f"{PROTOCOL_VARIABLE} is grpc (vLLM's default) but opentelemetry-exporter-otlp-proto-grpc is not "
            f"installed: set {PROTOCOL_VARIABLE}=http/protobuf and name the collector's OTLP/HTTP traces URL"
        ) from None
    return GrpcExporter(endpoint=endpoint, insecure=True)
