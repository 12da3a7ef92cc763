"""Traces (docs/router.md "Tracing"): the router's span tree of a request under the client's
traceparent, and the traceparent each engine call carries, seen through the engines' own spans
(the sim's `--otlp-traces-endpoint`, as vLLM's) in an OTLP/HTTP receiver on loopback; and a
collector that accepts and never answers, against the router's exit time and its JSON log."""

from __future__ import annotations

import contextlib
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from epd_kit.router.tracing import REQUEST_SPAN, SHUTDOWN_S
from epd_kit.testing.images import image_part, png_data_url, user_message
from epd_kit.testing.otlp import CLIENT, SERVER, OtlpReceiver, client_traceparent
from tests.budget import scaled

from .harness import Stack, wait_until

ENGINE_ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}  # as the kit's engine units


def ask(stack: Stack, header: str | None, stream: bool = False) -> None:
    headers = {"traceparent": header} if header else {}
    client = openai.OpenAI(base_url=stack.router.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    messages = [user_message("Describe this image.", image_part(png_data_url(160, 120, seed=7)))]
    answer = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, stream=stream, extra_headers=headers
    )
    if stream:
        assert list(answer)
    else:
        assert answer.choices[0].finish_reason


@pytest.fixture
def fast_export(monkeypatch):
    # the SDK's batch delay (5 s by default) for the router and the sims, which inherit it
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")


@contextlib.contextmanager
def traced_stack(ckpt, workdir, router_traced: bool) -> Iterator[tuple[Stack, OtlpReceiver]]:
    """An OTLP receiver, one VE and one PD exporting their spans to it, and the router (its spans
    too if `router_traced`); all stopped on exit."""
    with OtlpReceiver() as receiver:
        router = {"tracing": {"otlp_traces_endpoint": receiver.url}} if router_traced else {}
        stack = Stack.start(
            ckpt,
            workdir,
            n_ve=1,
            n_pd=1,
            sim_env={"epd-ve-0": ENGINE_ENV, "epd-pd-0": ENGINE_ENV},
            engine_args=("--otlp-traces-endpoint", receiver.url),
            **router,
        )
        try:
            yield stack, receiver
        finally:
            stack.stop()


def test_router_spans_continue_the_client_trace_and_reach_the_engines(ckpt, tmp_path, fast_export):
    with traced_stack(ckpt, tmp_path, router_traced=True) as (stack, receiver):
        trace_id, client_span, header = client_traceparent()
        ask(stack, header)
        names = [REQUEST_SPAN, "receive", "render", "ve encode", "pd generate", "llm_request", "llm_request"]
        spans = receiver.wait_for(trace_id, names, scaled(20))
        by_name = {s.name: s for s in spans}
        root = by_name[REQUEST_SPAN]
        # the client's trace goes on: the request span is the child of the client's span
        assert root.parent_id == client_span and root.kind == SERVER and root.service == "epd-router"
        assert root.attributes["http.response.status_code"] == 200
        for name in ("receive", "render", "ve encode", "pd generate"):
            assert by_name[name].parent_id == root.span_id, name
        ve_call, pd_call = by_name["ve encode"], by_name["pd generate"]
        assert ve_call.kind == pd_call.kind == CLIENT
        assert ve_call.attributes["epd.engine.id"] == "epd-ve-0"
        assert pd_call.attributes["epd.engine.id"] == "epd-pd-0"
        # each engine's span is the child of the call that carried its traceparent
        engine_spans = {s.parent_id: s for s in spans if s.name == "llm_request"}
        assert set(engine_spans) == {ve_call.span_id, pd_call.span_id}
        assert all(s.kind == SERVER for s in engine_spans.values())
        # vLLM's span (do_tracing): its external id, the router's request id behind generate-tokens-,
        # and no HTTP status (real 0.24.0/0.29.0 engines set none)
        ve_span, pd_span = engine_spans[ve_call.span_id], engine_spans[pd_call.span_id]
        pd_id = pd_span.attributes["gen_ai.request.id"]
        assert pd_id.startswith("generate-tokens-") and len(pd_id) > len("generate-tokens-")
        assert ve_span.attributes["gen_ai.request.id"] == f"{pd_id}/enc/epd-ve-0"
        assert not [s for s in engine_spans.values() if "http.response.status_code" in s.attributes]

        # a stream: its relay is a span of its own; a request without a traceparent starts a trace
        receiver.clear()
        ask(stack, None, stream=True)
        # the root ends (and is exported) after its stream span: wait for both
        wait_until(
            lambda: {"stream", REQUEST_SPAN} <= {s.name for s in receiver.spans}, 20, "the stream's and its root span"
        )
        roots = [s for s in receiver.spans if s.name == REQUEST_SPAN]
        assert len(roots) == 1 and roots[0].parent_id == ""
        streamed = receiver.wait_for(
            roots[0].trace_id, ["stream", "pd generate", "llm_request", "llm_request"], scaled(20)
        )
        assert {s.parent_id for s in streamed if s.name in ("stream", "pd generate")} == {roots[0].span_id}

        # a malformed traceparent is ignored (W3C: a new trace starts), never passed on
        receiver.clear()
        bad_trace = secrets.token_hex(16)
        ask(stack, f"00-{bad_trace.upper()}-{secrets.token_hex(8)}-01")
        wait_until(lambda: sum(s.name == "llm_request" for s in receiver.spans) >= 2, 20, "the engines' spans")
        assert not [s for s in receiver.spans if s.trace_id in (bad_trace, bad_trace.upper())]


def test_tracing_off_passes_the_client_traceparent_on(ckpt, tmp_path, fast_export):
    """The router exports nothing, yet the engines' spans join the client's trace."""
    with traced_stack(ckpt, tmp_path, router_traced=False) as (stack, receiver):
        trace_id, client_span, header = client_traceparent()
        ask(stack, header)
        spans = receiver.wait_for(trace_id, ["llm_request", "llm_request"], scaled(20))
        assert {s.parent_id for s in spans} == {client_span}
        assert not [s for s in receiver.spans if s.service == "epd-router"]


class BlackHole:
    """A collector that accepts connections and never answers (nor reads): the worst a trace
    export can meet. Loopback only; its connections are held until `close`."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.getsockname()[1]}/v1/traces"

    def _accept(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                self._held.append(self._server.accept()[0])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in [*self._held, self._server]:
            conn.close()


def test_a_collector_that_never_answers_costs_no_shutdown_and_client_headers_no_log(ckpt, tmp_path, fast_export):
    """Issue 58: SIGTERM took 19.7-30.2 s with such a collector, and a tracestate of 33 members
    logged a plain-text line per request. Now the exit waits at most tracing.SHUTDOWN_S for the
    last export, and the bad header is a count on /metrics."""
    hole = BlackHole()
    stack = Stack.start(ckpt, tmp_path, n_ve=1, n_pd=1, tracing={"otlp_traces_endpoint": hole.url})
    try:
        trace_id, _, header = client_traceparent()
        state = ",".join(f"k{i}=v{i}" for i in range(33))
        with httpx.Client(base_url=stack.router.url, timeout=30, trust_env=False) as client:
            for _ in range(20):  # bounded: 20 traced requests, each 4 spans, for the queue
                answer = client.post(
                    "/v1/chat/completions",
                    json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                    headers={"traceparent": header, "tracestate": state},
                )
                assert answer.status_code == 200, answer.text
            # the export thread has a batch out to the collector (its 100 ms delay passed)
            wait_until(lambda: hole._held, 10, "an export connection to the collector")
            metrics = client.get("/metrics").text
        assert 'epd_router_trace_context_errors_total{header="tracestate"} 20.0' in metrics
        started = time.monotonic()
        stack.router.process.signal(signal.SIGTERM)
        assert stack.router.process.wait_exit(30) == 0
        took = time.monotonic() - started
        print(f"SIGTERM to exit with a collector that never answers: {took:.2f} s")  # shown with -s
        assert took < SHUTDOWN_S + 3, f"SIGTERM to exit took {took:.1f} s"
        log = stack.router.log()
        plain = [line for line in log.splitlines() if line.strip() and not line.startswith("{")]
        assert not plain, plain[:5]
        assert trace_id not in log
    finally:
        stack.stop()
        hole.close()
