"""Traces through real engines: with epd_otlp_traces_endpoint set, the router's span tree of a
request and each real vLLM engine's own `llm_request` span land under one trace id in an
OTLP/HTTP receiver, each engine's span the child of the router's call that carried its
`traceparent` (docs/observability.md "Traces"). The engines run the plan's vllm-cpu argv and
environment for that setting: `--otlp-traces-endpoint` and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL.
The pair is the one test_serving.py serves through (conftest.py traced_pair, started once for
both), so the receiver holds that module's spans too: a test here reads its own request's trace
(its traceparent's trace id, its x-request-id), never counts over all spans.
"""

from __future__ import annotations

import secrets
import time

import openai
import pytest

from epd_kit.router.tracing import REQUEST_SPAN
from epd_kit.testing.images import image_part, png_data_url
from epd_kit.testing.otlp import CLIENT, SERVER, Span, client_traceparent
from tests.budget import scaled
from tests.router_processes.harness import wait_until
from tests.vllm_dist import installed_vllm

from .stack import PD_MAX_MODEL_LEN

MAX_TOKENS = 5
# the images' seeds (png_data_url) are 100 and up, apart from test_serving.py's: the pair's EC
# store is shared, and test_serving counts a new image as a new entry
# a VE request's generated tokens: 0.24's encoder-only runner emits its stand-in token, 0.29's
# scheduler stops the request once encoded (docs/compat.md)
VE_COMPLETION_TOKENS = {"0.24.0": 1, "0.29.0": 0}


@pytest.fixture
def client(traced_pair):
    with traced_pair[0].client(MAX_TOKENS) as one:
        yield one


def one(spans: list[Span], name: str) -> Span:
    named = [s for s in spans if s.name == name]
    assert len(named) == 1, f"{len(named)} spans {name!r} in {sorted(s.name for s in spans)}"
    return named[0]


def engine_span_under(spans: list[Span], call: Span) -> Span:
    """The engine's own span the router's call `call` led to: vLLM's `llm_request`, a SERVER span
    whose parent is the call's span (the traceparent the call carried)."""
    children = [s for s in spans if s.parent_id == call.span_id]
    assert [s.name for s in children] == ["llm_request"], f"under {call.name}: {children}"
    assert children[0].kind == SERVER
    return children[0]


def test_an_image_request_is_one_trace_through_router_ve_and_pd(traced_pair, client):
    _, receiver = traced_pair
    trace_id, client_span, header = client_traceparent()
    usage = client.chat(
        "Describe this image.", image_part(png_data_url(64, 48, seed=111)), headers={"traceparent": header}
    )[2]
    wanted = [REQUEST_SPAN, "receive", "render", "ve encode", "pd generate", "llm_request", "llm_request"]
    spans = receiver.wait_for(trace_id, wanted, scaled(60))
    root = one(spans, REQUEST_SPAN)
    assert root.parent_id == client_span and root.service == "epd-router"
    ve_call, pd_call = one(spans, "ve encode"), one(spans, "pd generate")
    assert ve_call.parent_id == pd_call.parent_id == root.span_id
    assert ve_call.kind == pd_call.kind == CLIENT
    assert (ve_call.attributes["epd.engine.id"], pd_call.attributes["epd.engine.id"]) == ("epd-ve-0", "epd-pd-0")
    ve_span, pd_span = engine_span_under(spans, ve_call), engine_span_under(spans, pd_call)
    # vLLM's own figures on its span: the PD's are what the client was told; its request id is
    # vLLM's external id of the router's engine request id (0.24 and 0.29: "generate-tokens-<id>")
    assert pd_span.attributes["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert pd_span.attributes["gen_ai.usage.completion_tokens"] == usage.completion_tokens
    assert pd_span.attributes["gen_ai.request.max_tokens"] == MAX_TOKENS
    engine_request_id = pd_span.attributes["gen_ai.request.id"]
    # the VE got the image's tokens alone (a synthetic prompt, no text) and was asked for one
    # token, under the PD's request id (docs/contract.md §2.2)
    assert 0 < ve_span.attributes["gen_ai.usage.prompt_tokens"] < usage.prompt_tokens
    assert ve_span.attributes["gen_ai.request.max_tokens"] == 1
    assert ve_span.attributes["gen_ai.usage.completion_tokens"] == VE_COMPLETION_TOKENS[installed_vllm()[1]]
    assert ve_span.attributes["gen_ai.request.id"] == f"{engine_request_id}/enc/epd-ve-0"


def test_a_streamed_text_request_has_no_ve_span_and_its_stream_span(traced_pair, client):
    _, receiver = traced_pair
    trace_id, client_span, header = client_traceparent()
    usage = client.chat("Say something.", headers={"traceparent": header}, stream=True)[2]
    spans = receiver.wait_for(trace_id, [REQUEST_SPAN, "pd generate", "stream", "llm_request"], scaled(60))
    root = one(spans, REQUEST_SPAN)
    assert root.parent_id == client_span
    assert one(spans, "stream").parent_id == root.span_id
    assert not [s for s in spans if s.name == "ve encode"]
    pd_span = engine_span_under(spans, one(spans, "pd generate"))
    assert pd_span.attributes["gen_ai.usage.completion_tokens"] == usage.completion_tokens
    assert [s.name for s in spans].count("llm_request") == 1


def test_a_request_without_traceparent_starts_a_trace_the_engines_join(traced_pair, client):
    _, receiver = traced_pair
    request_id = f"untraced-{secrets.token_hex(8)}"  # the router's request span carries it (epd.request_id)
    image = image_part(png_data_url(64, 48, seed=112))
    client.chat("Describe this image.", image, headers={"x-request-id": request_id})

    def roots() -> list[Span]:
        return [
            s for s in receiver.spans if s.name == REQUEST_SPAN and s.attributes.get("epd.request_id") == request_id
        ]

    wait_until(roots, 60, "the router's span of the request")
    [root] = roots()
    assert root.parent_id == ""
    spans = receiver.wait_for(root.trace_id, ["ve encode", "pd generate", "llm_request", "llm_request"], scaled(60))
    engine_span_under(spans, one(spans, "ve encode"))
    engine_span_under(spans, one(spans, "pd generate"))


def test_a_request_past_the_pds_context_has_the_routers_spans_and_no_engines(traced_pair, client):
    """A prompt past the PD's --max-model-len: the router refuses it as vLLM's chat route does,
    before any engine call (router/context_window.py, issue 58), so its trace holds the router's
    request, receive and render spans and no engine call or engine span. (Before, the VE encoded
    it and the PD's input processor refused it, untraced by vLLM.)"""
    _, receiver = traced_pair
    trace_id, _, header = client_traceparent()
    long_text = " ".join(f"word{i}" for i in range(PD_MAX_MODEL_LEN))
    with pytest.raises(openai.BadRequestError):
        client.chat(image_part(png_data_url(64, 48, seed=115)), long_text, headers={"traceparent": header})
    spans = receiver.wait_for(trace_id, [REQUEST_SPAN, "receive", "render"], scaled(60))
    assert one(spans, REQUEST_SPAN).attributes["http.response.status_code"] == 400
    time.sleep(1)  # ten of the engines' export intervals (OTEL_BSP_SCHEDULE_DELAY): an engine span would be in
    names = {s.name for s in receiver.trace(trace_id)}
    assert not names & {"ve encode", "pd generate", "llm_request"}, names


def test_requests_are_served_while_the_collector_is_down(traced_pair, client):
    """The exports run beside the requests (the SDK's batch processors): a collector that is
    gone costs the router and the engines failed exports, never a failed request; once it is
    back, the next request's spans reach it. The receiver is back for what runs after (the pair
    is shared: test_serving.py may come next)."""
    stack, receiver = traced_pair
    receiver.close()  # its port now refuses connections
    try:
        for seed in (113, 114):
            image = image_part(png_data_url(64, 48, seed=seed))
            usage = client.chat("Describe this image.", image, stream=seed == 114)[2]
            assert usage.completion_tokens == MAX_TOKENS
        assert all(one.process.returncode is None for one in stack.engines), "an engine exited"
    finally:
        receiver.reopen()
    trace_id, _, header = client_traceparent()
    client.chat("Say something.", headers={"traceparent": header})
    # a batch that failed is retried for up to 10 s (the SDK's export timeout) before the next goes
    receiver.wait_for(trace_id, [REQUEST_SPAN, "pd generate", "llm_request"], scaled(60))
