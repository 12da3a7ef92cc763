"""The request path over scripted engines (scripted_engines.py: each test decides what every
engine answers, which real engines cannot be made to do on cue): the one PD retry loop of the
streaming and non-streaming paths, and the re-encode an EC-load failure triggers.
The same path against real simulated engines is tests/router_processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import httpx
import pytest

from epd_kit.router import upstream
from epd_kit.router.context import RequestContext
from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import parse_request
from epd_kit.router.service import RouterService
from epd_kit.router_yaml import parse_config
from tests.unit.router import scripted_engines

VE_PORTS = {11: "epd-ve-0", 12: "epd-ve-1"}
PD_PORTS = {21: "epd-pd-0", 22: "epd-pd-1"}
EC_LOAD = "ECLoadFailure: Encoder-cache load failed for mm_hashes: ['h1']"
# a real vLLM PD's answer once its engine core died, whatever the cause (a failed read among them)
ENGINE_DEAD = upstream.ENGINE_DEAD_MESSAGE


@dataclass
class PdCall:
    engine: str
    locators: dict


@dataclass
class Engines:
    """Scripted VEs and PDs. `pd_failures`: what the next PD calls answer instead of
    success, in order: ("http", status, message) or ("frame", code, message)."""

    pd_failures: list[tuple[str, int, str]] = field(default_factory=list)
    encodes: list[tuple[str, list[str]]] = field(default_factory=list)
    pd_calls: list[PdCall] = field(default_factory=list)
    blocks: int = 0
    hang_mid_stream: bool = False  # a PD that sends one event, then nothing
    bad_ids: set[str] = field(default_factory=set)  # PDs whose every answer has ids outside the vocabulary

    def handler(self, request: httpx.Request) -> httpx.Response:
        port = request.url.port
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        if port in VE_PORTS:
            return self._encode(VE_PORTS[port], body)
        return self._generate(PD_PORTS[port], body)

    def _encode(self, ve: str, body: dict) -> httpx.Response:
        hashes = body["features"]["mm_hashes"]["image"]
        self.encodes.append((ve, hashes))
        locators = {}
        for h in hashes:
            self.blocks += 1
            locators[h] = {
                "engine_id": ve,
                "host": "127.0.0.1",
                "port": 14600,
                "remote_block_ids": [self.blocks],
                "num_tokens": 4,
            }
        return httpx.Response(
            200,
            json={
                "request_id": body["request_id"],
                "choices": [{"token_ids": [0]}],
                "kv_transfer_params": {"ec_locator": locators},
            },
        )

    def _generate(self, pd: str, body: dict) -> httpx.Response:
        locators = body["sampling_params"]["extra_args"]["kv_transfer_params"]["ec_locator"]
        self.pd_calls.append(PdCall(pd, locators))
        stream = body.get("stream", False)
        if self.pd_failures:
            how, code, message = self.pd_failures.pop(0)
            error = {"error": {"message": message, "type": "EngineError", "code": code}}
            if how == "http":
                return httpx.Response(code, json=error)
            return sse_response([error])
        rid = body["request_id"]
        last = -1 if pd in self.bad_ids else 105  # -1: no token of any vocabulary
        if not stream:
            return httpx.Response(200, json={"request_id": rid, "choices": [{"token_ids": [72, last]}]})
        frames = [
            {"request_id": rid, "choices": [{"index": 0, "token_ids": [72]}]},
            {"request_id": rid, "choices": [{"index": 0, "token_ids": [last], "finish_reason": "stop"}]},
        ]
        return sse_response(frames, hang=self.hang_mid_stream)


def sse_response(docs: list[dict], hang: bool = False) -> httpx.Response:
    async def body():  # a stream, as an engine sends it (bytes would arrive already read)
        for doc in docs:
            yield b"data: " + json.dumps(doc).encode() + b"\n\n"
            if hang:
                await asyncio.sleep(3600)
        yield b"data: [DONE]\n\n"

    return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})


@pytest.fixture
async def make_service(char_renderer, make_item):
    started: list[RouterService] = []
    stack = contextlib.AsyncExitStack()

    async def make(
        engines: Engines,
        max_attempts: int = 3,
        health: dict | None = None,
        ec_read_failure: str = "engine_dies",
        **timeouts: float,
    ) -> RouterService:
        logical = [f"http://127.0.0.1:{port}" for port in [*VE_PORTS, *PD_PORTS]]
        real = await stack.enter_async_context(scripted_engines.serve(engines.handler, logical))
        cfg = parse_config(
            {
                "model": "/m",
                "ec_read_failure": ec_read_failure,
                "health": {"interval_s": 60, **(health or {})},
                "retries": {"max_attempts": max_attempts},
                "timeouts": {"pd_s": 30, **timeouts},
                "endpoints": {
                    "ve": [{"id": ve, "url": real[f"http://127.0.0.1:{port}"]} for port, ve in VE_PORTS.items()],
                    "pd": [{"id": pd, "url": real[f"http://127.0.0.1:{port}"]} for port, pd in PD_PORTS.items()],
                },
            }
        )
        items = [make_item("h1", 1, 4), make_item("h2", 6, 4), make_item("h1", 11, 4)]
        renderer = char_renderer(list(range(16)), items)
        service = RouterService(cfg, renderer)
        await service.start()
        started.append(service)
        return service

    yield make
    for service in started:
        await service.stop()
    await stack.aclose()


async def answer(service: RouterService, stream: bool) -> str:
    """Run one request through the path under test; the answer's text."""
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}], "stream": stream})
    ctx = RequestContext.start(chat, "rid", service.state.cfg)
    if not stream:
        return (await service.generation.complete(ctx))["choices"][0]["message"]["content"]
    pd = await service.generation.open_stream(ctx)
    outcome = service.metrics.track_request()
    frames = [f async for f in service.generation.relay(ctx, pd, outcome)]
    assert frames[-1] == b"data: [DONE]\n\n" and outcome.status == "200"
    return "".join(json.loads(f[6:])["choices"][0]["delta"].get("content", "") for f in frames[:-1])


def retries(service: RouterService, stage: str) -> float:
    labels = {"stage": stage, "model": service.state.cfg.model_name}
    return service.metrics.registry.get_sample_value("epd_router_retries_total", labels) or 0.0


def all_slots_free(service: RouterService) -> bool:
    return all(e.inflight == 0 and e.inflight_work == 0 for e in service.state.pools.all())


def engine_failures(service: RouterService, engine: str) -> float:
    labels = {"engine": engine, "role": "pd"}
    return service.metrics.registry.get_sample_value("epd_router_engine_failures_total", labels) or 0.0


@pytest.mark.parametrize("said", [EC_LOAD, ENGINE_DEAD], ids=["ec-load", "engine-dead"])
@pytest.mark.parametrize(
    ("stream", "how"), [(False, "http"), (True, "http"), (True, "frame")], ids=["complete", "stream", "stream-frame"]
)
async def test_ec_load_failure_re_encodes_then_retries_on_another_pd(make_service, stream, how, said):
    engines = Engines()
    service = await make_service(engines)
    # a PD reads both VEs' blocks first (h1 and h2 go to different VEs): after a failed read
    # the request moves only to blocks of VEs a PD has read from
    assert await answer(service, False) == "Hi"
    engines.pd_calls.clear()
    engines.encodes.clear()
    engines.pd_failures.append((how, 500, said))
    assert await answer(service, stream) == "Hi"
    first, second = engines.pd_calls
    assert first.engine != second.engine
    encoded = sorted(h for _, hashes in engines.encodes for h in hashes)
    assert encoded == ["h1", "h1", "h2", "h2"]  # every unique item once, then once again
    assert set(first.locators) == set(second.locators) == {"h1", "h2"}
    for h in ("h1", "h2"):  # the retry reads the fresh blocks, not the ones that failed
        assert first.locators[h]["remote_block_ids"] != second.locators[h]["remote_block_ids"]
    assert retries(service, "generate") == 1
    assert all_slots_free(service)


def ve_failures(service: RouterService) -> float:
    return sum(
        service.metrics.registry.get_sample_value("epd_router_engine_failures_total", {"engine": ve, "role": "ve"})
        or 0.0
        for ve in VE_PORTS.values()
    )


@pytest.mark.parametrize(
    ("stream", "how"), [(False, "http"), (True, "http"), (True, "frame")], ids=["complete", "stream", "stream-frame"]
)
async def test_a_generation_error_is_a_failed_read_of_the_ves_where_the_pds_connector_says_so(
    make_service, stream, how
):
    """router.yaml `ec_read_failure: generation_error` (the kit's NIXL connector: a failed read ends
    the request alone as vLLM's generic generation error, the PD lives): the VEs of the request are
    charged, its items encoded again, the PD call retried once; the PD is never charged."""
    engines = Engines(pd_failures=[(how, 500, upstream.GENERATION_ERROR_MESSAGE)])
    service = await make_service(engines, ec_read_failure="generation_error")
    assert await answer(service, stream) == "Hi"
    first, second = engines.pd_calls
    assert sorted(h for _, hashes in engines.encodes for h in hashes) == ["h1", "h1", "h2", "h2"]
    for h in ("h1", "h2"):  # the retry reads fresh blocks
        assert first.locators[h]["remote_block_ids"] != second.locators[h]["remote_block_ids"]
    assert ve_failures(service) == 2  # h1's and h2's VEs
    assert engine_failures(service, "epd-pd-0") == engine_failures(service, "epd-pd-1") == 0
    assert retries(service, "generate") == 1
    assert all_slots_free(service)


async def test_a_second_failed_read_of_a_living_pd_is_the_clients_502_and_no_third_call(make_service):
    error = ("http", 500, upstream.GENERATION_ERROR_MESSAGE)
    engines = Engines(pd_failures=[error, error, error])
    service = await make_service(engines, ec_read_failure="generation_error")
    with pytest.raises(RouterError) as info:
        await answer(service, False)
    assert info.value.status == 502 and "vLLM generation error" in info.value.message
    assert len(engines.pd_calls) == 2 and retries(service, "generate") == 1
    assert engine_failures(service, "epd-pd-0") == engine_failures(service, "epd-pd-1") == 0
    assert all_slots_free(service)


async def test_without_the_key_a_generation_error_is_no_failed_read_in_an_ec_locator_fleet(make_service):
    """vllm-neuron's PD dies on a failed read (ec_read_failure: engine_dies, the default): its
    generation error is another failure, retried elsewhere with the same blocks, nobody charged."""
    engines = Engines(pd_failures=[("http", 500, upstream.GENERATION_ERROR_MESSAGE)])
    service = await make_service(engines)
    assert await answer(service, False) == "Hi"
    first, second = engines.pd_calls
    assert first.engine != second.engine and first.locators == second.locators
    assert ve_failures(service) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_other_pd_failures_retry_without_re_encoding(make_service, stream):
    engines = Engines(pd_failures=[("http", 503, "engine dead")])
    service = await make_service(engines)
    assert await answer(service, stream) == "Hi"
    assert len(engines.pd_calls) == 2 and len(engines.encodes) <= 2  # the initial fan-out only
    assert sorted(h for _, hashes in engines.encodes for h in hashes) == ["h1", "h2"]
    assert engines.pd_calls[0].locators == engines.pd_calls[1].locators
    assert all_slots_free(service)


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_a_pd_refusal_is_the_clients_and_not_retried(make_service, stream):
    engines = Engines(pd_failures=[("http", 400, "prompt too long")])
    service = await make_service(engines)
    with pytest.raises(RouterError) as info:
        await answer(service, stream)
    assert info.value.status == 400 and "prompt too long" in info.value.message
    assert len(engines.pd_calls) == 1 and retries(service, "generate") == 0
    assert all_slots_free(service)


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_attempts_are_bounded_and_the_last_failure_is_reported(make_service, stream):
    engines = Engines(pd_failures=[("http", 500, "first"), ("http", 500, "second"), ("http", 500, "third")])
    service = await make_service(engines, max_attempts=2)
    with pytest.raises(RouterError) as info:
        await answer(service, stream)
    assert info.value.status == 502 and "second" in info.value.message
    assert len(engines.pd_calls) == 2 and len({c.engine for c in engines.pd_calls}) == 2
    assert retries(service, "generate") == 1
    assert all_slots_free(service)


async def test_a_pd_hung_mid_stream_ends_its_stream_within_the_gap(make_service):
    """Streams on a PD that hung mid-stream waited pd_s and got 'exceeded
    the router's total timeout'; the failure was not counted against the PD. Now the stream
    ends after timeouts.stream_gap_s with an error naming the PD and the cause, counted."""
    engines = Engines(hang_mid_stream=True)
    service = await make_service(engines, stream_gap_s=0.3)
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    ctx = RequestContext.start(chat, "rid", service.state.cfg)
    pd = await service.generation.open_stream(ctx)
    outcome = service.metrics.track_request()
    t = time.monotonic()
    frames = [f async for f in service.generation.relay(ctx, pd, outcome)]
    assert time.monotonic() - t < 0.3 + 1.0  # the gap, not pd_s (30 s here)
    error = json.loads(frames[-1][6:])["error"]  # the router's frame, nothing after it
    assert outcome.status == "stream_error" and error["code"] == 504
    assert error["message"] == "generation stalled: no token for 0.3s" and "127.0.0.1" not in frames[-1].decode()
    failures = service.metrics.registry.get_sample_value(
        "epd_router_engine_failures_total", {"engine": pd.engine.id, "role": "pd"}
    )
    assert failures == 1 and all_slots_free(service)


@dataclass
class GatedEngines(Engines):
    """PD calls wait for `gate` before they answer: the moment after the encodes returned and
    before the PD read the blocks, when a drained VE used to look idle."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    pd_waiting: asyncio.Event = field(default_factory=asyncio.Event)

    async def handler(self, request: httpx.Request) -> httpx.Response:  # type: ignore[override]
        if request.url.port in PD_PORTS and request.url.path.startswith("/inference"):  # not the probes
            self.pd_waiting.set()
            await self.gate.wait()
        return super().handler(request)


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_a_ve_stays_in_flight_until_the_pd_call_that_reads_its_blocks_ends(make_service, stream):
    """A drain waits for `inflight` 0. A VE's encode returns before the PD reads its blocks, and
    a VE stopped in between kills the PD's engine core (ECLoadFailure, docs/contract.md §3.5): a
    day-2 step that moved the VEs lost both PDs for 17 s under load. The VE's count now lasts
    until the request is over; its encode work (the load measure) leaves at once."""
    engines = GatedEngines()
    service = await make_service(engines)
    task = asyncio.create_task(answer(service, stream))
    await asyncio.wait_for(engines.pd_waiting.wait(), 10)
    encoders = {ve for ve, _ in engines.encodes}
    assert encoders, "no encode ran"
    live = {e.id: (e.inflight, e.inflight_work) for e in service.state.pools.ve}
    # one count per VE and request, however many of its items the VE encoded
    assert live == {ve: (1, 0) if ve in encoders else (0, 0) for ve in live}, live
    engines.gate.set()
    assert await asyncio.wait_for(task, 10) == "Hi"
    assert all_slots_free(service)


async def test_token_ids_outside_the_vocabulary_are_charged_to_the_pd_and_retried(make_service, caplog):
    """They were a plain 502, not counted against the PD, so a PD sending them was
    never ejected and a non-streaming request was not retried. Now they are the PD's invalid
    answer: charged, retried on another PD, and the PD is ejected after failure_threshold
    consecutive ones (its /health, which answers 200, readmits it: then it starts again)."""
    engines = Engines(bad_ids={"epd-pd-0"})
    service = await make_service(engines, health={"failure_threshold": 2, "failure_ratio": 1.0})
    bad = service.state.pools.by_id()["epd-pd-0"]
    for _ in range(6):  # every request is answered, whichever PD it meets first
        assert await answer(service, False) == "Hi"
    tried_bad = sum(c.engine == "epd-pd-0" for c in engines.pd_calls)
    ejections = [r for r in caplog.records if r.getMessage() == "engine ejected" and r.engine == "epd-pd-0"]
    assert tried_bad >= 2 and engine_failures(service, "epd-pd-0") == tried_bad == retries(service, "generate")
    assert len(ejections) == tried_bad // 2  # at every failure_threshold-th consecutive failure
    assert "outside the model's vocabulary" in bad.last_error and "outside" in ejections[0].reason
    assert engine_failures(service, "epd-pd-1") == 0 and all_slots_free(service)


async def test_token_ids_outside_the_vocabulary_end_a_stream_charged_to_its_pd(make_service):
    engines = Engines(bad_ids={"epd-pd-0", "epd-pd-1"})
    service = await make_service(engines)
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    ctx = RequestContext.start(chat, "rid", service.state.cfg)
    pd = await service.generation.open_stream(ctx)
    outcome = service.metrics.track_request()
    frames = [f async for f in service.generation.relay(ctx, pd, outcome)]
    error = json.loads(frames[-1][6:])["error"]
    assert outcome.status == "stream_error" and error == {
        "message": "the engine sent an invalid answer",
        "type": "upstream_error",
        "param": None,
        "code": 502,
    }
    assert engine_failures(service, pd.engine.id) == 1 and all_slots_free(service)
