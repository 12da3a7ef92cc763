"""Hung engines and engine request ids, over scripted engines (scripted_engines.py): a VE
that takes an encode and never answers costs each request its derived deadline, is ejected
as hung although its /health says 200, stays out while a serving probe cannot get an answer,
and comes back once one does. The same against a real simulated VE: tests/router_processes."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import pytest

from epd_kit.router import deadlines
from epd_kit.router.context import RequestContext
from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import parse_request
from epd_kit.router.service import RouterService
from epd_kit.router_yaml import Timeouts, parse_config
from tests.unit.router import scripted_engines

VE_URL, PD_URL = "http://127.0.0.1:11", "http://127.0.0.1:21"


@dataclass
class Engines:
    ve_hangs: bool = False
    bodies: list[dict] = field(default_factory=list)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)  # a hung engine's /health often still answers
        body = json.loads(request.content)
        self.bodies.append(body)
        rid = body["request_id"]
        if request.url.port == 11:
            if self.ve_hangs:
                await asyncio.sleep(3600)
            locators = {
                h: {"engine_id": "epd-ve-0", "host": "127.0.0.1", "port": 1, "remote_block_ids": [1], "num_tokens": 4}
                for h in body["features"]["mm_hashes"]["image"]
            }
            return httpx.Response(
                200,
                json={
                    "request_id": rid,
                    "choices": [{"token_ids": [0]}],
                    "kv_transfer_params": {"ec_locator": locators},
                },
            )
        await asyncio.sleep(0.01)
        return httpx.Response(200, json={"request_id": rid, "choices": [{"token_ids": [72, 105]}]})


@pytest.fixture
async def service(char_renderer, make_item):
    engines = Engines()
    async with scripted_engines.serve(engines.handler, [VE_URL, PD_URL]) as real:
        cfg = parse_config(
            {
                "model": "/m",
                "timeouts": {"encode_base_s": 0.3, "encode_per_1k_tokens_s": 0},
                "health": {"interval_s": 0.05, "failure_threshold": 2},
                "endpoints": {
                    "ve": [{"id": "epd-ve-0", "url": real[VE_URL]}],
                    "pd": [{"id": "epd-pd-0", "url": real[PD_URL]}],
                },
            }
        )
        renderer = char_renderer(list(range(12)), [make_item("h1", 2, 4)])
        svc = RouterService(cfg, renderer)
        svc.scripted = engines  # type: ignore[attr-defined]
        await svc.start()
        yield svc
        await svc.stop()


async def ask(service: RouterService, request_id: str = "rid") -> dict:
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}]})
    return await service.generation.complete(RequestContext.start(chat, request_id, service.state.cfg))


async def test_a_hung_ve_costs_its_deadline_then_stays_out_until_it_serves(service):
    engines: Engines = service.scripted
    ve = service.state.pools.ve[0]
    assert (await ask(service))["choices"][0]["message"]["content"] == "Hi"
    engines.ve_hangs = True
    for _ in range(2):
        t = time.monotonic()
        with pytest.raises(RouterError) as info:
            await ask(service)
        assert time.monotonic() - t < 0.3 + 0.5  # its deadline, not the 600 s cap
        assert info.value.status == 504 and "no answer within 0.3s" in info.value.message
    assert not ve.healthy and ve.needs_serving_probe and ve.inflight == 0
    await asyncio.sleep(0.5)  # ten probe rounds: /health says 200, the serving probe hangs
    assert not ve.healthy
    with pytest.raises(RouterError) as info:
        await ask(service)
    assert info.value.status == 503
    engines.ve_hangs = False  # it serves again: the next serving probe readmits it
    for _ in range(100):
        if ve.healthy:
            break
        await asyncio.sleep(0.02)
    assert ve.healthy and not ve.needs_serving_probe
    assert (await ask(service))["choices"][0]["message"]["content"] == "Hi"
    probes = [b["request_id"] for b in engines.bodies if b["request_id"].startswith("probe-")]
    assert probes  # the serving probe is a real encode


async def test_engines_get_unique_ids_whatever_the_client_sends(service):
    engines: Engines = service.scripted
    answers = await asyncio.gather(*(ask(service, "same-id") for _ in range(3)))
    assert {a["id"] for a in answers} == {"chatcmpl-same-id"}
    ids = [b["request_id"] for b in engines.bodies]
    assert len(ids) == 6 and len(set(ids)) == 6  # 3 encodes (<id>/enc/epd-ve-0) + 3 generates
    assert not any("same-id" in i for i in ids)
    assert sum(i.endswith("/enc/epd-ve-0") for i in ids) == 3


def test_deadlines_grow_with_the_work_and_stop_at_the_caps():
    t = Timeouts(
        encode_base_s=10,
        encode_per_1k_tokens_s=5,
        first_token_base_s=15,
        first_token_per_1k_tokens_s=2,
        per_token_s=0.5,
        ve_s=60,
        pd_s=100,
    )
    assert deadlines.encode_s(t, 2000) == 20 and deadlines.encode_s(t, 100_000) == 60
    assert deadlines.first_token_s(t, 5000) == 25 and deadlines.first_token_s(t, 10**6) == 100
    assert deadlines.answer_s(t, 5000, 20) == 35 and deadlines.answer_s(t, 5000, None) == 100
