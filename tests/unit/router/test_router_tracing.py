"""router/tracing.py off: which client trace context is passed on to the engines, byte for byte
(the router writes it into the engine request's head), and the sim's protocol rules."""

from __future__ import annotations

import re

import pytest

from epd_kit.router import tracing
from epd_kit.router.config import Tracing as TracingSettings
from epd_kit.sim.tracing import SimTracer

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def passed_on(headers: dict[str, str]) -> bytes:
    """What an engine call made while this request runs carries."""
    off = tracing.Tracing(TracingSettings())
    handle = off.begin(headers)
    try:
        return tracing.engine_headers()
    finally:
        off.finish(handle, None)
        assert tracing.engine_headers() == b""  # nothing stays for the next request


def test_a_valid_traceparent_and_tracestate_are_passed_on_unchanged():
    assert passed_on({"traceparent": VALID}) == f"traceparent: {VALID}\r\n".encode()
    both = passed_on({"traceparent": VALID, "tracestate": "congo=t61rcWkgMzE"})
    assert both == f"traceparent: {VALID}\r\ntracestate: congo=t61rcWkgMzE\r\n".encode()


@pytest.mark.parametrize(
    "value",
    [
        VALID.upper(),  # W3C: lower-case hex only
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # a version the router does not parse
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero span id
        VALID + "-extra",
        VALID[:-1],
        "",
    ],
)
def test_an_invalid_traceparent_is_dropped(value):
    assert passed_on({"traceparent": value, "tracestate": "a=b"}) == b""


def test_a_tracestate_that_is_not_header_safe_is_dropped_alone():
    assert passed_on({"traceparent": VALID, "tracestate": "a=b\x7f"}) == f"traceparent: {VALID}\r\n".encode()
    assert passed_on({"traceparent": VALID, "tracestate": "a" * 513}) == f"traceparent: {VALID}\r\n".encode()


def test_off_the_router_has_no_tracer_and_no_span():
    off = tracing.Tracing(TracingSettings())
    assert not off.enabled
    assert tracing.span("render") is tracing.NULL_SPAN


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "Unsupported OTLP protocol 'http/json' is configured"),
        ({}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is grpc (vLLM's default) but opentelemetry-exporter-otlp-proto-grpc"),
    ],
)
def test_the_sim_refuses_a_protocol_it_cannot_export(env, message):
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401

        if not env:
            pytest.skip("the gRPC exporter is installed here: the sim would export over gRPC")
    except ImportError:
        pass
    with pytest.raises(ValueError, match=re.escape(message)):
        SimTracer.for_endpoint("http://127.0.0.1:4318/v1/traces", env)
