"""`--otlp-traces-endpoint` as vLLM reads it (v0.24.0 and v0.29.0, the same code in both):

- the flag names the collector; unset, tracing is off, and a request that carries a trace
  context is served as any other, with one warning for the engine's life ("Received a request
  with trace context but tracing is disabled": vllm/tracing/utils.py, `@run_once`);
- the exporter's protocol is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, "grpc" when unset, or
  "http/protobuf" (the flag is then the full traces URL); any other value is refused
  (vllm/tracing/otel.py `get_span_exporter`);
- a request gets its `llm_request` span when it finishes in the engine: vLLM's output processor
  calls `do_tracing` (vllm/v1/engine/output_processor.py) for an engine core output with a
  finish reason (stop, length, or error: a failed generation, fault `generation_error_rate`).
  A request refused before the engine (a 400) never gets there, nor does one the client left
  (AsyncLLM.abort -> abort_requests drops its state, the engine's later output is ignored), nor
  one the engine's death or shutdown ended: no span for any of them;
- the span: kind SERVER, child of the context the request's `traceparent`/`tracestate` headers
  carry (vllm/entrypoints/serve/engine/serving.py `_get_trace_headers`), from the request's
  arrival, ended when it is emitted; instrumentation scope `vllm.tracing.otel`
  (`manual_instrument_otel`'s `trace.get_tracer(__name__)`); attributes exactly do_tracing's
  (SpanAttributes, vllm/tracing/utils.py): `gen_ai.request.id` (the external id,
  `generate-tokens-<the body's request_id>`), `gen_ai.usage.prompt_tokens` (the body's
  token_ids), `gen_ai.usage.completion_tokens` (tokens generated: a VE's per release,
  release.py `ve_finish`), the six `gen_ai.latency.*`, and `gen_ai.request.max_tokens`, `.n`,
  `.temperature`, `.top_p` only when truthy (`if req_state.top_p:`), as vLLM's SamplingParams
  holds them (`request_attributes`);
- the resource is the SDK's default (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES; else
  service.name `unknown_service:python`, as a real vLLM's spans had) plus
  `vllm.instrumenting_module_name` and `vllm.process_id` (vllm/tracing/otel.py
  `init_otel_tracer`).

The latencies, from the sim's own clock (`RequestTrace`; vLLM's RequestStateStats):
queued = the engine took the request (PD: `submit`; VE: it waits for the encoder), scheduled =
it got its slot (PD: `_admit`, its EC load then counts as prefill, as the consumer's load runs
in vLLM's model step; VE: the encoder's lock), first token = its first output (PD: the end of
its prefill; VE: the end of the encode, also in 0.29 where that output has no token), last
token = its last output. time_in_queue = scheduled - queued, time_in_model_prefill = first
token - scheduled, time_in_model_decode = last - first token, time_in_model_inference = last
token - scheduled, time_to_first_token = first token - arrival, e2e = the finish - arrival.
vLLM takes arrival, time_to_first_token and e2e from the wall clock and the others from the
engine core's monotonic one; the sim takes all from its one monotonic clock (the span's start
is arrival's wall time). Arrival is when the body has been read and parsed (vLLM's
InputProcessor stamps it there too).

One difference: the sim ships the OTLP/HTTP exporter only (the kit's own dependency); "grpc"
needs opentelemetry-exporter-otlp-proto-grpc, which vLLM requires and the kit does not, and is
refused at start with that said when it is missing. The kit's engine units set http/protobuf.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..wire import GenerateRequest, stream_request_id

log = logging.getLogger("epd_sim.tracing")

PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
MODULE_NAME = "vllm.llm_engine"  # vllm/v1/engine/async_llm.py init_tracer's
SCOPE_NAME = "vllm.tracing.otel"  # the tracer do_tracing's span comes from
TRACED_FINISHES = frozenset({"stop", "length", "error"})  # an engine core output's finish reasons

Handler = Callable[[Request], Awaitable[Response]]


class SimTracer:
    """The engine's tracer: one `llm_request` span per request the engine finishes."""

    def __init__(self, exporter: Any) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"vllm.instrumenting_module_name": MODULE_NAME, "vllm.process_id": str(os.getpid())})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer(SCOPE_NAME)
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def for_endpoint(cls, endpoint: str, env: Mapping[str, str]) -> SimTracer:
        """Raises ValueError with vLLM's message for a protocol it refuses, or the sim's for
        grpc without its exporter."""
        return cls(_exporter(endpoint, env.get(PROTOCOL_VARIABLE, "grpc")))

    def shutdown(self) -> None:
        self._provider.shutdown()

    def request(
        self, headers: Mapping[str, str], req: GenerateRequest, request_id: str, max_model_len: int
    ) -> RequestTrace:
        """A request arriving now: `request_id` the caller's, `headers` its HTTP headers."""
        carrier = {h: headers[h] for h in TRACE_HEADERS if h in headers}
        return RequestTrace(
            tracer=self,
            context=self._propagator.extract(carrier),
            request_id=stream_request_id(request_id),  # vLLM's external id on the generate route
            prompt_tokens=len(req.token_ids),
            params=request_attributes(req, max_model_len),
        )

    def finished(self, trace: RequestTrace) -> None:
        """do_tracing's span for a request that finished now."""
        from opentelemetry.trace import SpanKind

        end = time.monotonic()
        attributes: dict[str, Any] = {
            "gen_ai.latency.time_to_first_token": trace.first_token - trace.arrival,
            "gen_ai.latency.e2e": end - trace.arrival,
            "gen_ai.latency.time_in_queue": trace.scheduled - trace.queued,
            "gen_ai.usage.prompt_tokens": trace.prompt_tokens,
            "gen_ai.usage.completion_tokens": trace.completion_tokens,
            "gen_ai.latency.time_in_model_prefill": trace.first_token - trace.scheduled,
            "gen_ai.latency.time_in_model_decode": trace.last_token - trace.first_token,
            "gen_ai.latency.time_in_model_inference": trace.last_token - trace.scheduled,
            "gen_ai.request.id": trace.request_id,
            **trace.params,
        }
        span = self._tracer.start_span(
            SPAN_NAME, context=trace.context, kind=SpanKind.SERVER, start_time=trace.arrival_ns, attributes=attributes
        )
        span.end()


@dataclass(eq=False)
class RequestTrace:
    """One traced request as do_tracing reads it: its id, prompt and sampling attributes
    (vLLM's RequestState) and its clock (RequestStateStats), kept by the engine serving it."""

    tracer: SimTracer
    context: Any  # the parent the trace headers carry
    request_id: str
    prompt_tokens: int
    params: dict[str, Any]  # the gen_ai.request.* attributes besides the id
    arrival_ns: int = field(default_factory=time.time_ns)
    arrival: float = field(default_factory=time.monotonic)
    queued: float = 0.0
    scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    completion_tokens: int = 0

    def queue(self) -> None:
        self.queued = time.monotonic()

    def schedule(self) -> None:
        self.scheduled = time.monotonic()

    def output(self, tokens: int) -> None:
        """An output of the engine for this request, with `tokens` new tokens (0: none)."""
        now = time.monotonic()
        if not self.first_token:
            self.first_token = now
        self.last_token = now
        self.completion_tokens += tokens

    def finish(self, reason: str) -> None:
        """The request ended with `reason`: a span if the engine finished it (TRACED_FINISHES)."""
        if reason in TRACED_FINISHES:
            self.tracer.finished(self)


def request_attributes(req: GenerateRequest, max_model_len: int) -> dict[str, Any]:
    """`gen_ai.request.max_tokens`, `.n`, `.temperature`, `.top_p` as do_tracing sets them: each
    only when truthy, from the SamplingParams vLLM holds: its defaults for what the body leaves
    out (n 1, temperature 1.0, top_p 1.0), a temperature in (0, 1e-2) raised to 1e-2 and a greedy
    one's top_p 1.0 (SamplingParams.__post_init__), and max_tokens, when absent, the generate
    route's default, the context the prompt leaves (get_max_tokens)."""
    sp = req.sampling_params
    temperature = 1.0 if sp.temperature is None else float(sp.temperature)
    top_p = 1.0 if sp.top_p is None else float(sp.top_p)
    if 0 < temperature < 1e-2:
        temperature = 1e-2
    if temperature < 1e-5:
        top_p = 1.0
    given = "max_tokens" in sp.model_fields_set
    values = {
        "gen_ai.request.top_p": top_p,
        "gen_ai.request.max_tokens": sp.max_tokens if given else max_model_len - len(req.token_ids),
        "gen_ai.request.temperature": temperature,
        "gen_ai.request.n": 1 if sp.n is None else sp.n,
    }
    return {name: value for name, value in values.items() if value}


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
