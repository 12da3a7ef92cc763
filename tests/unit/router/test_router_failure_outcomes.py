"""Encoder-side failures of docs/router.md "Failure outcomes" that no other test covered, on
scripted engines through the router's real request path: a VE that fails or answers without
its blocks (retried on the item's next HRW choice, charged), a VE that refuses the request's
content (the client's 400, not charged), a VE whose block geometry a PD cannot take (the VE
charged and the request moved to other blocks: no second PD is sent them), and an image
request with no VE left (503, never a silent text-only answer)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import pytest

from epd_kit.router.context import RequestContext
from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import parse_request
from tests.unit.router.test_router_generation import (
    Engines,
    PdCall,
    all_slots_free,
    answer,
    make_service,  # noqa: F401  (the fixture)
    retries,
)

# vLLM's handshake check (docs/contract.md §3.5: `block_len` mismatch → ValueError "EC region
# block_len mismatch…"), as an engine that names it in its answer would (a real vLLM PD, and the
# sim since, answer only EngineDeadError's message: test_router_engine_death.py)
BLOCK_LEN = (
    "BlockLenMismatch: EC region block_len mismatch: remote engine epd-ve-0 advertises 131072 "
    "bytes/block, local region has 262144 bytes/block"
)


@dataclass
class FailingVes(Engines):
    """Scripted engines whose next VE calls answer `ve_failures` (status, body) first."""

    ve_failures: list[tuple[int, dict]] = field(default_factory=list)
    ve_calls: list[str] = field(default_factory=list)
    hung_pds: set[str] = field(default_factory=set)  # take the request, send nothing

    def _encode(self, ve: str, body: dict) -> httpx.Response:
        self.ve_calls.append(ve)
        if self.ve_failures:
            status, doc = self.ve_failures.pop(0)
            return httpx.Response(status, json=doc)
        return super()._encode(ve, body)

    def _generate(self, pd: str, body: dict) -> httpx.Response:
        if pd not in self.hung_pds:
            return super()._generate(pd, body)
        self.pd_calls.append(PdCall(pd, {}))

        async def nothing():
            await asyncio.sleep(3600)
            yield b""

        return httpx.Response(200, content=nothing(), headers={"content-type": "text/event-stream"})


def ve_failures(service, engine: str) -> float:
    labels = {"engine": engine, "role": "ve"}
    return service.metrics.registry.get_sample_value("epd_router_engine_failures_total", labels) or 0.0


NO_LOCATORS = {"request_id": "x", "choices": [{"token_ids": [0]}]}  # a 200 without kv_transfer_params


@pytest.mark.parametrize(
    "failure",
    [(500, {"error": {"message": "boom", "code": 500}}), (200, NO_LOCATORS)],
    ids=["http-500", "no-locators"],
)
async def test_a_failed_ve_call_is_retried_on_the_next_choice_and_charged(make_service, failure):  # noqa: F811
    engines = FailingVes(ve_failures=[failure])
    service = await make_service(engines)
    assert await answer(service, False) == "Hi"
    first = engines.ve_calls[0]
    assert ve_failures(service, first) == 1
    assert retries(service, "encode") == 1
    # every item the failed VE held was encoded again on the other VE before the PD read it
    assert {ve for ve, _ in engines.encodes} - {first}
    assert all(loc["engine_id"] != first for loc in engines.pd_calls[0].locators.values())
    assert all_slots_free(service)


async def test_a_ve_refusing_the_content_is_the_clients_400_and_not_charged(make_service):  # noqa: F811
    engines = FailingVes(ve_failures=[(400, {"error": {"message": "1088 patches exceed 1024", "code": 400}})])
    service = await make_service(engines)
    with pytest.raises(RouterError) as info:
        await answer(service, False)
    assert info.value.status == 400 and "1088 patches" in info.value.envelope("r")["error"]["message"]
    assert ve_failures(service, engines.ve_calls[0]) == 0 and retries(service, "encode") == 0
    assert engines.pd_calls == []  # nothing reached a PD
    assert all_slots_free(service)


async def test_blocks_of_the_wrong_geometry_charge_the_ve_and_reach_no_second_pd(make_service):  # noqa: F811
    """A PD that cannot take a VE's block geometry dies as on a failed read (contract §3.5):
    before, the router charged that PD and sent the same blocks to the next PD, which died
    too; now it is an EC-load failure: the VEs are charged, the items encoded again."""
    engines = FailingVes()
    service = await make_service(engines)
    assert await answer(service, False) == "Hi"  # a PD has read both VEs' blocks
    engines.pd_calls.clear()
    engines.pd_failures.append(("http", 500, BLOCK_LEN))
    assert await answer(service, False) == "Hi"
    first, second = engines.pd_calls
    for h in ("h1", "h2"):  # the retry reads fresh blocks, not the ones the first PD refused
        assert first.locators[h]["remote_block_ids"] != second.locators[h]["remote_block_ids"]
    charged = [ve.id for ve in service.state.pools.ve if ve.failures]
    assert charged, "no VE was charged for the blocks"
    assert all_slots_free(service)


async def test_an_image_request_with_no_ve_left_is_a_503_not_a_text_answer(make_service):  # noqa: F811
    engines = FailingVes()
    service = await make_service(engines)
    for ve in service.state.pools.ve:
        ve.blocks_unreadable("test: out of service")
    with pytest.raises(RouterError) as info:
        await answer(service, False)
    assert info.value.status == 503 and "cannot encode images" in info.value.message
    assert info.value.retry_after is not None
    assert engines.pd_calls == []  # never generated without the image
    assert all_slots_free(service)


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_a_pd_hung_before_its_first_token_costs_its_deadline_and_moves(make_service, stream):  # noqa: F811
    engines = FailingVes(hung_pds={"epd-pd-0", "epd-pd-1"})
    service = await make_service(engines, first_token_base_s=0.3, first_token_per_1k_tokens_s=0, per_token_s=0)
    # with max_tokens the non-streaming deadline is first_token_base_s + per_token_s each
    # (without it, `timeouts.pd_s`: docs/router.md "Request path")
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 4})
    ctx = RequestContext.start(chat, "rid", service.state.cfg)
    call = service.generation.open_stream(ctx) if stream else service.generation.complete(ctx)
    t = time.monotonic()
    with pytest.raises(RouterError) as info:
        await call
    assert time.monotonic() - t < 2 * 0.3 + 1.0  # two deadlines, not the pd_s cap
    assert info.value.status == 504 and "(generate)" in info.value.envelope("r")["error"]["message"]
    assert sorted(c.engine for c in engines.pd_calls) == ["epd-pd-0", "epd-pd-1"]  # retried once, elsewhere
    assert all(pd.failures == 1 for pd in service.state.pools.pd)  # each charged a timeout
    assert all_slots_free(service)
