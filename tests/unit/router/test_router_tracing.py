"""router/tracing.py off: which client trace context is passed on to the engines, byte for byte
(the router writes it into the engine request's head), and the sim's protocol rules."""

from __future__ import annotations

import asyncio
import re

import pytest

from epd_kit.router import tracing
from epd_kit.router_yaml import Tracing as TracingSettings
from epd_kit.sim.tracing import SimTracer
from epd_kit.testing.otlp import OtlpReceiver

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


# --- on: who decides sampling, and what a client's bad headers cost ------------------------


def begun(on: tracing.Tracing, headers) -> tuple[object, bytes]:
    """`begin`'s handle and the trace headers an engine call of that request carries."""
    handle = on.begin(headers)
    try:
        if isinstance(handle, tracing.RequestTrace):
            with tracing.engine_call(_Engine(), "pd generate"):
                return handle, tracing.engine_headers()
        return handle, tracing.engine_headers()
    finally:
        on.finish(handle, None)


class _Engine:
    id, role, url = "pd-0", "pd", "http://127.0.0.1:1"


SAMPLED = VALID  # flags 01
TRACE_ID = VALID.split("-")[1]


@pytest.fixture(scope="module")
def collector():
    """An OTLP/HTTP receiver that takes every export (these tests read none). Not a port nothing
    listens on: the exporter retries a refused export for up to its 10 s timeout and logs an
    ERROR when it gives up, and aclose() leaves an unfinished shutdown to its daemon thread
    (router/tracing.py SHUTDOWN_S), so a test's exports went on failing into a later test's
    caplog (test_trace_context_errors_are_counted_not_logged failed so in a full run)."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture
def traced(collector):
    """traced(invalid=None, **settings) -> tracing on, exporting to `collector`; each closed at
    the test's end."""
    made: list[tracing.Tracing] = []

    def make(invalid=None, **settings) -> tracing.Tracing:
        cfg = TracingSettings(otlp_traces_endpoint=collector.url, **settings)
        made.append(tracing.Tracing(cfg, invalid or (lambda header: None)))
        return made[-1]

    yield make
    for on in made:
        asyncio.run(on.aclose())


def test_a_client_sampled_flag_cannot_override_sample_ratio_zero(traced):
    """Issue 58: `sample_ratio: 0` and a client's sampled traceparent traced every request."""
    on = traced(sample_ratio=0.0)
    for _ in range(20):
        handle, sent = begun(on, {"traceparent": SAMPLED})
        assert not isinstance(handle, tracing.RequestTrace)
        # the client's trace goes on to the engines, its sampled flag cleared: not steered either
        assert sent == f"traceparent: {SAMPLED[:-2]}00\r\n".encode()


def test_the_router_samples_by_its_own_draw_not_the_client_trace_id(traced):
    """A TraceIdRatioBased sampler keeps low trace ids: a client could pick one. The router draws."""
    on = traced(sample_ratio=0.5)
    low = "00-00000000000000000000000000000001-00f067aa0ba902b7-01"
    kept = sum(isinstance(begun(on, {"traceparent": low})[0], tracing.RequestTrace) for _ in range(400))
    assert 120 < kept < 280  # binomial(400, 0.5): outside is a 1e-20 event


def test_a_sampled_request_joins_the_client_trace(traced):
    on = traced(sample_ratio=1.0)
    handle, sent = begun(on, {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"})
    assert isinstance(handle, tracing.RequestTrace)
    assert sent.startswith(f"traceparent: 00-{TRACE_ID}-".encode()) and sent.endswith(b"-01\r\n")


def test_trace_context_errors_are_counted_not_logged(traced, capfd, caplog):
    """Issue 58: a tracestate of 33 members logged a plain-text line per request."""
    counted: list[str] = []
    on = traced(invalid=counted.append, sample_ratio=1.0)
    state = ",".join(f"k{i}=v{i}" for i in range(33))
    handle, sent = begun(on, {"traceparent": VALID, "tracestate": state})
    assert isinstance(handle, tracing.RequestTrace)  # the traceparent stands without it
    assert b"tracestate" not in sent
    begun(on, {"traceparent": VALID.upper()})
    assert counted == ["tracestate", "traceparent"]
    assert not caplog.records
    assert capfd.readouterr().err == ""


def headers_of(*pairs: tuple[str, str]):
    from starlette.datastructures import Headers

    return Headers(raw=[(k.encode(), v.encode()) for k, v in pairs])


def test_several_tracestate_headers_are_combined_in_order():
    """W3C §3.3: several tracestate fields are one list, combined as RFC 7230 §3.2.2 says."""
    headers = headers_of(("traceparent", VALID), ("tracestate", "a=1,b=2"), ("tracestate", " c=3"))
    assert passed_on(headers) == f"traceparent: {VALID}\r\ntracestate: a=1,b=2,c=3\r\n".encode()
    # empty members are allowed and skipped; a repeated key breaks the list (dropped whole)
    assert passed_on(headers_of(("traceparent", VALID), ("tracestate", "a=1,,b=2"))).endswith(b"a=1,b=2\r\n")
    assert passed_on(headers_of(("traceparent", VALID), ("tracestate", "a=1"), ("tracestate", "a=2"))) == (
        f"traceparent: {VALID}\r\n".encode()
    )


def test_two_traceparent_headers_are_invalid():
    counted: list[str] = []
    off = tracing.Tracing(TracingSettings(), counted.append)
    headers = headers_of(("traceparent", VALID), ("traceparent", VALID))
    assert off.begin(headers) is None
    assert counted == ["traceparent"]


@pytest.mark.parametrize(
    "state",
    [
        ",".join(f"k{i}=v" for i in range(33)),  # 33 members: the spec's limit is 32
        "A=1",  # keys are lower case
        "a=b=c",  # '=' is not a value character
        "a=1,b",  # a member without '='
        "t@" + "x" * 15 + "=1",  # a vendor part over 14 characters
        "a=" + "v" * 257,  # a value over 256 characters
    ],
)
def test_tracestate_that_breaks_the_grammar_is_dropped_whole(state):
    assert tracing.parse_tracestate([state]) is None


def test_tracestate_within_the_grammar_is_kept():
    assert tracing.parse_tracestate([",".join(f"k{i}=v" for i in range(32))]) is not None
    assert tracing.parse_tracestate([" a=1 \t", "t@" + "x" * 14 + "=1"]) == [("a", "1"), ("t@" + "x" * 14, "1")]


def test_a_client_sampled_flag_is_ignored_by_default(traced):
    """tracing.trust_parent_sampled is off unless set: the router's draw decides both ways."""
    assert TracingSettings().trust_parent_sampled is False
    on = traced(sample_ratio=1.0)
    unsampled = f"{SAMPLED[:-2]}00"
    handle, sent = begun(on, {"traceparent": unsampled})
    assert isinstance(handle, tracing.RequestTrace)  # the client said "not sampled"; the router traced
    assert sent.endswith(b"-01\r\n")


def test_trust_parent_sampled_follows_a_valid_client_flag_and_draws_without_one(traced):
    """Behind a gateway that samples: a valid traceparent's sampled flag decides (sample_ratio 0 and
    a sampled parent: traced in the client's trace; ratio 1 and an unsampled one: not traced, passed
    on unchanged); without a valid traceparent the router's own draw decides."""
    counted: list[str] = []
    never = traced(invalid=counted.append, sample_ratio=0.0, trust_parent_sampled=True)
    always = traced(sample_ratio=1.0, trust_parent_sampled=True)
    for _ in range(5):
        handle, sent = begun(never, {"traceparent": SAMPLED})
        assert isinstance(handle, tracing.RequestTrace)
        assert sent.startswith(f"traceparent: 00-{TRACE_ID}-".encode()) and sent.endswith(b"-01\r\n")
    unsampled = f"{SAMPLED[:-2]}00"
    handle, sent = begun(always, {"traceparent": unsampled})
    assert not isinstance(handle, tracing.RequestTrace)
    assert sent == f"traceparent: {unsampled}\r\n".encode()
    # other flag bits set with bit 0 (W3C §3.2.2.5: only bit 0 is "sampled")
    assert isinstance(begun(never, {"traceparent": f"{SAMPLED[:-2]}03"})[0], tracing.RequestTrace)
    assert not isinstance(begun(always, {"traceparent": f"{SAMPLED[:-2]}02"})[0], tracing.RequestTrace)
    # no traceparent, or an invalid one (counted): the router's draw
    assert not isinstance(begun(never, {})[0], tracing.RequestTrace)
    assert isinstance(begun(always, {})[0], tracing.RequestTrace)
    assert not isinstance(begun(never, {"traceparent": SAMPLED.upper()})[0], tracing.RequestTrace)
    assert counted == ["traceparent"]
