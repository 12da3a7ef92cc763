"""Request orchestration pieces that need no engine: PD admission (cap, bounded queue,
429/503 with Retry-After), the exact VE/PD bodies (contract §2.2, §3.1), reload semantics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import yaml

from epd_kit.router import upstream
from epd_kit.router.config import parse_config
from epd_kit.router.errors import RouterError
from epd_kit.router.service import RouterService
from epd_kit.wire import EcLocator, GenerateRequest


@dataclass(frozen=True)
class FakeItem:
    mm_hash: str
    offset: int
    length: int
    ve_kwargs_b64: str
    pd_kwargs_b64: str


class NoRenderer:
    async def render(self, messages, *, add_generation_prompt=True):
        raise AssertionError("not used")

    def detokenize(self, ids, skip_special_tokens=True):
        return ""

    def detokenizer(self, *, skip_special_tokens=True):
        raise AssertionError("not used")


def config(**placement):
    return {
        "model": "/m",
        "placement": {"pd_max_inflight": 1, "queue_size": 1, "queue_timeout_s": 0.3, **placement},
        "endpoints": {
            "ve": [{"id": "epd-ve-0", "url": "http://127.0.0.1:1"}],
            "pd": [{"id": "epd-pd-0", "url": "http://127.0.0.1:2"}, {"id": "epd-pd-1", "url": "http://127.0.0.1:3"}],
        },
    }


def service(**placement) -> RouterService:
    svc = RouterService(parse_config(config(**placement)), NoRenderer())
    for e in svc.pools.all():
        e.healthy = True
    return svc


async def test_pd_admission_cap_queue_and_429():
    svc = service()
    a = await svc.acquire_pd(set(), None)
    b = await svc.acquire_pd(set(), None)
    assert {a.id, b.id} == {"epd-pd-0", "epd-pd-1"}  # least outstanding spreads
    waiter = asyncio.create_task(svc.acquire_pd(set(), None))  # queued (queue_size 1)
    await asyncio.sleep(0.05)
    with pytest.raises(RouterError) as full:
        await svc.acquire_pd(set(), None)
    assert full.value.status == 429 and full.value.retry_after and "wait queue is full" in full.value.message
    await svc.release_pd(a)
    c = await asyncio.wait_for(waiter, 1)
    assert c is a and a.inflight == 1
    with pytest.raises(RouterError) as timed_out:
        await svc.acquire_pd(set(), None)
    assert timed_out.value.status == 429 and "waited 0.3s" in timed_out.value.message


async def test_no_healthy_pd_is_503_not_429():
    svc = service()
    for e in svc.pools.pd:
        e.healthy = False
    with pytest.raises(RouterError) as info:
        await svc.acquire_pd(set(), None)
    assert info.value.status == 503 and info.value.retry_after >= 1
    assert "no healthy active PD (2 configured)" in info.value.message
    assert not svc.ready


async def test_draining_pd_gets_no_new_work(tmp_path):
    path = tmp_path / "r.yaml"
    cfg = config(pd_max_inflight=8)
    path.write_text(yaml.safe_dump(cfg))
    svc = RouterService(parse_config(cfg), NoRenderer(), config_path=path)
    for e in svc.pools.all():
        e.healthy = True
    held = await svc.acquire_pd(set(), None)
    cfg["endpoints"]["pd"][0]["state"] = "draining"
    path.write_text(yaml.safe_dump(cfg))
    assert svc.reload()
    picks = {(await svc.acquire_pd(set(), None)).id for _ in range(5)}
    assert picks == {"epd-pd-1"}
    # engines survive the reload with their counters: in-flight work is still accounted
    pd0 = svc.pools.by_id()["epd-pd-0"]
    assert pd0.inflight == (1 if held.id == "epd-pd-0" else 0)
    cfg["endpoints"]["pd"].append({"id": "epd-pd-2", "url": "http://127.0.0.1:4"})
    path.write_text(yaml.safe_dump(cfg))
    assert svc.reload()
    added = svc.pools.by_id()["epd-pd-2"]
    assert added.healthy is False  # unknown until its first probe answers
    assert svc.pools.by_id()["epd-pd-1"].healthy is True  # survivors keep their state
    path.write_text("endpoints: [")
    assert not svc.reload()
    assert svc.pools.by_id()["epd-pd-0"].state.value == "draining"


def test_ve_body_is_contract_exact():
    items = [FakeItem("h1", 15, 4, "K1", "P1"), FakeItem("h2", 40, 3, "K2", "P2")]
    body = upstream.ve_request_body("rid", "epd-ve-1", items)
    assert body == {
        "request_id": "rid/enc/epd-ve-1",
        "token_ids": [0] * 7,
        "features": {
            "mm_hashes": {"image": ["h1", "h2"]},
            "mm_placeholders": {"image": [{"offset": 0, "length": 4}, {"offset": 4, "length": 3}]},
            "kwargs_data": {"image": ["K1", "K2"]},
        },
        "sampling_params": {"max_tokens": 1},
    }
    GenerateRequest.model_validate(body)


def test_pd_body_keeps_duplicates_and_carries_locators():
    items = [FakeItem("h1", 2, 4, "K1", "P1"), FakeItem("h2", 8, 3, "K2", "P2"), FakeItem("h1", 12, 4, "K1", "P1")]
    loc = {h: EcLocator(engine_id="epd-ve-0", host="127.0.0.1", port=14600, remote_block_ids=[i], num_tokens=4)
           for i, h in enumerate(["h1", "h2"])}
    sampling = {"max_tokens": 5, "output_kind": 1, "extra_args": {"mine": 1, "kv_transfer_params": {"x": 1}}}
    body = upstream.pd_request_body("rid", list(range(20)), items, sampling, loc, stream=True)
    assert body["request_id"] == "rid" and body["token_ids"] == list(range(20))
    assert body["features"]["mm_hashes"] == {"image": ["h1", "h2", "h1"]}
    assert body["features"]["kwargs_data"] == {"image": ["P1", "P2", "P1"]}  # LM-only kwargs
    assert body["features"]["mm_placeholders"]["image"][2] == {"offset": 12, "length": 4}
    extra = body["sampling_params"]["extra_args"]
    assert extra["mine"] == 1 and set(extra["kv_transfer_params"]) == {"ec_locator"}
    assert extra["kv_transfer_params"]["ec_locator"]["h2"]["remote_block_ids"] == [1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    text_only = upstream.pd_request_body("r", [1, 2], [], {"output_kind": 2}, {}, stream=False)
    assert text_only["features"] == {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}}
    assert "stream" not in text_only
    assert text_only["sampling_params"]["extra_args"] == {"kv_transfer_params": {"ec_locator": {}}}


def test_encode_body_splices_blobs_losslessly():
    import base64
    import json
    import os

    big = base64.b64encode(os.urandom(30_000)).decode()
    odd = 'x"\\' * 2000 + "é"  # needs escaping: must go through json.dumps
    items = [FakeItem("h1", 0, 4, big, "P"), FakeItem("h2", 4, 4, odd, "P"), FakeItem("h3", 8, 4, "small", "P")]
    body = upstream.ve_request_body("rid", "epd-ve-0", items)
    data = upstream.encode_body(body)
    assert json.loads(data) == body
    assert big.encode() in data
    text_only = upstream.pd_request_body("r", [1], [], {"output_kind": 2}, {}, stream=False)
    assert json.loads(upstream.encode_body(text_only)) == text_only
