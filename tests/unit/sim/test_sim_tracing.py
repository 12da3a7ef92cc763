"""The sim's `--otlp-traces-endpoint` span as vLLM 0.24.0/0.29.0's (epd_kit/sim/tracing.py): one
`llm_request` for a request the engine finishes, none for one refused or abandoned, with
do_tracing's attributes, exactly; engines in process, spans in memory."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from sim_args import config, pd_args, ve_args

from epd_kit.sim.app import SimEngine, create_app
from epd_kit.sim.client import fake_image, ve_body
from epd_kit.sim.faults import Faults
from epd_kit.sim.pd import build_sequence
from epd_kit.sim.profile import PROFILES
from epd_kit.sim.tracing import SimTracer, request_attributes
from epd_kit.wire import GENERATE_PATH, GenerateRequest, SamplingParams

# the attributes of the spans real vLLM 0.24.0 and 0.29.0 engines sent behind the kit's router
# (vllm/tracing/utils.py SpanAttributes, set by do_tracing)
VLLM_ATTRIBUTES = {
    "gen_ai.latency.e2e",
    "gen_ai.latency.time_in_model_decode",
    "gen_ai.latency.time_in_model_inference",
    "gen_ai.latency.time_in_model_prefill",
    "gen_ai.latency.time_in_queue",
    "gen_ai.latency.time_to_first_token",
    "gen_ai.request.id",
    "gen_ai.request.max_tokens",
    "gen_ai.request.n",
    "gen_ai.request.temperature",
    "gen_ai.request.top_p",
    "gen_ai.usage.completion_tokens",
    "gen_ai.usage.prompt_tokens",
}
MAX_MODEL_LEN = 256
PROMPT = [11, 12, 13, 14, 15, 16, 17]
SLOW = dataclasses.replace(PROFILES["zero"], decode_ms_per_token=5.0)


@dataclasses.dataclass
class Traced:
    engine: SimEngine
    client: httpx.AsyncClient
    tracer: SimTracer
    exporter: InMemorySpanExporter

    def spans(self) -> list[Any]:
        """Every span so far (the tracer's batch is flushed; a test reads them once, at its end)."""
        self.tracer.shutdown()
        return list(self.exporter.get_finished_spans())


@asynccontextmanager
async def traced(cfg, profile=PROFILES["zero"]) -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter()
    tracer = SimTracer(exporter)
    engine = SimEngine(cfg, profile, Faults())
    await engine.start()
    transport = httpx.ASGITransport(app=create_app(engine, tracer))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            yield Traced(engine, client, tracer, exporter)
    finally:
        await engine.stop()
        tracer.shutdown()


def pd_config(tiny_ckpt):
    return config(pd_args(str(tiny_ckpt), max_model_len=MAX_MODEL_LEN), "0-7")


def pd_request(request_id: str = "r1", **sampling: Any) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, token_ids=PROMPT, sampling_params=SamplingParams(**sampling))


def traceparent() -> tuple[str, str]:
    span_id = secrets.token_hex(8)
    return span_id, f"00-{secrets.token_hex(16)}-{span_id}-01"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_finished_request_gets_vllms_span_with_its_own_figures(tiny_ckpt, monkeypatch, stream) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    parent, header = traceparent()
    async with traced(pd_config(tiny_ckpt), SLOW) as t:
        body = pd_request(max_tokens=5, ignore_eos=True).wire_dict() | {"stream": stream}
        answer = await t.client.post(GENERATE_PATH, json=body, headers={"traceparent": header})
        assert answer.status_code == 200, answer.text
        spans = t.spans()
    assert len(spans) == 1
    span = spans[0]
    assert span.name == "llm_request" and span.kind == SpanKind.SERVER and span.parent.span_id == int(parent, 16)
    assert span.instrumentation_scope.name == "vllm.tracing.otel"
    assert span.resource.attributes["service.name"] == "unknown_service:python"  # the SDK's default, as vLLM's
    attrs = dict(span.attributes)
    assert set(attrs) == VLLM_ATTRIBUTES  # no http.response.status_code: vLLM sets none
    assert attrs["gen_ai.request.id"] == "generate-tokens-r1"
    assert attrs["gen_ai.usage.prompt_tokens"] == len(PROMPT) and attrs["gen_ai.usage.completion_tokens"] == 5
    assert attrs["gen_ai.request.max_tokens"] == 5 and attrs["gen_ai.request.n"] == 1
    assert attrs["gen_ai.request.temperature"] == 1.0 and attrs["gen_ai.request.top_p"] == 1.0
    latency = {k.removeprefix("gen_ai.latency."): v for k, v in attrs.items() if k.startswith("gen_ai.latency.")}
    assert all(v >= 0 for v in latency.values()), latency
    # four decode steps of 5 ms after the first token; the figures add up as vLLM's do
    assert latency["time_in_model_decode"] >= 0.015
    assert latency["time_in_model_inference"] == pytest.approx(
        latency["time_in_model_prefill"] + latency["time_in_model_decode"]
    )
    assert latency["e2e"] >= latency["time_to_first_token"] >= latency["time_in_model_prefill"]
    assert latency["e2e"] >= latency["time_in_queue"] + latency["time_in_model_inference"]


async def test_a_request_refused_before_the_engine_gets_no_span(tiny_ckpt) -> None:
    async with traced(pd_config(tiny_ckpt)) as t:
        past_the_context = GenerateRequest(request_id="long", token_ids=[11] * (MAX_MODEL_LEN + 1)).wire_dict()
        for body in (past_the_context, pd_request(n=2).wire_dict(), {"token_ids": "no"}):
            answer = await t.client.post(GENERATE_PATH, json=body, headers={"traceparent": traceparent()[1]})
            assert answer.status_code == 400, answer.text
        assert t.spans() == []


async def _finish(t: Traced, end: Callable[[Any], None] | None = None, **seq: Any) -> None:
    """A request straight into the PD's engine loop; `end` ends it once it has begun decoding."""
    cfg = t.engine.cfg
    req = pd_request(request_id="engine", max_tokens=50, ignore_eos=True)
    sequence = build_sequence(req, cfg, "engine")
    sequence.trace = t.tracer.request({}, req, "engine", cfg.max_model_len)
    for name, value in seq.items():
        setattr(sequence, name, value)
    assert t.engine.pd is not None
    t.engine.pd.submit(sequence)
    if end is not None:
        await asyncio.wait_for(_decoding(sequence), 5)
        end(sequence)
    await asyncio.wait_for(sequence.wait_done(), 5)


async def _decoding(sequence: Any) -> None:
    while sequence.emitted < 2:
        sequence.event.clear()
        await sequence.event.wait()


async def test_a_request_the_client_left_or_the_engines_death_ended_gets_no_span(tiny_ckpt) -> None:
    """vLLM: the client gone -> AsyncLLM.abort -> abort_requests drops the request's state; a dead
    engine core -> propagate_error. Neither goes through do_tracing."""
    async with traced(pd_config(tiny_ckpt), SLOW) as t:
        assert t.engine.pd is not None
        await _finish(t, t.engine.pd.abort)
        await _finish(t, lambda _: t.engine.pd.die(RuntimeError("simulated engine death")))  # type: ignore[union-attr]
        assert t.spans() == []


async def test_a_failed_generation_is_finished_by_the_engine_and_gets_its_span(tiny_ckpt) -> None:
    """FinishReason.ERROR comes in an engine core output, as stop and length do: do_tracing runs."""
    async with traced(pd_config(tiny_ckpt), SLOW) as t:
        await _finish(t, fail_after=3)
        spans = t.spans()
    assert len(spans) == 1 and spans[0].attributes["gen_ai.usage.completion_tokens"] == 3


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        # vLLM's SamplingParams defaults; max_tokens absent: the context the prompt leaves
        ({}, {"top_p": 1.0, "max_tokens": MAX_MODEL_LEN - len(PROMPT), "temperature": 1.0, "n": 1}),
        # greedy: temperature 0 is left out (falsy), top_p forced to 1.0 (SamplingParams.__post_init__)
        ({"temperature": 0, "top_p": 0.5, "max_tokens": 4}, {"top_p": 1.0, "max_tokens": 4, "n": 1}),
        # a tiny temperature is raised to 1e-2; max_tokens given as null stays unset, left out
        ({"temperature": 0.001, "top_p": 0.9, "max_tokens": None}, {"top_p": 0.9, "temperature": 0.01, "n": 1}),
    ],
)
def test_the_request_attributes_are_vllms_sampling_params_left_out_when_falsy(sampling, expected) -> None:
    got = request_attributes(pd_request(**sampling), MAX_MODEL_LEN)
    assert got == {f"gen_ai.request.{k}": v for k, v in expected.items()}


@pytest.mark.parametrize(("vllm", "completion_tokens"), [("0.24", 1), ("0.29", 0)])
async def test_a_ves_span_counts_the_tokens_its_release_generates(
    tiny_ckpt, monkeypatch, vllm, completion_tokens
) -> None:
    """0.24's encoder-only runner samples a stand-in token; 0.29's none (release.py ve_finish), as
    real 0.24.0 and 0.29.0 VEs' spans showed."""
    monkeypatch.setenv("EPD_SIM_VLLM", vllm)
    args = ve_args(str(tiny_ckpt))
    extra = {"side_channel_host": "127.0.0.1", "side_channel_port": 0}
    args = dataclasses.replace(args, ec_transfer_config={**args.ec_transfer_config, "ec_connector_extra_config": extra})
    cfg = config(args, "8-11")
    body = ve_body([fake_image((1, 8, 8), 5, cfg.vision)], request_id="r1/enc/epd-ve-0")
    async with traced(cfg) as t:
        answer = await t.client.post(GENERATE_PATH, json=body)
        assert answer.status_code == 200, answer.text
        spans = t.spans()
    assert len(spans) == 1
    attrs = dict(spans[0].attributes)
    assert set(attrs) == VLLM_ATTRIBUTES
    assert attrs["gen_ai.request.id"] == "generate-tokens-r1/enc/epd-ve-0"
    assert attrs["gen_ai.usage.completion_tokens"] == completion_tokens
    assert attrs["gen_ai.usage.prompt_tokens"] == len(body["token_ids"]) and attrs["gen_ai.request.max_tokens"] == 1
    # one output, the encode's end: no decode, the first token is the last
    assert attrs["gen_ai.latency.time_in_model_decode"] == 0.0
    assert attrs["gen_ai.latency.time_in_model_inference"] == attrs["gen_ai.latency.time_in_model_prefill"]
