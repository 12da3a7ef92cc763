"""A PD's logprobs through the ASGI app (scripted PDs on 127.0.0.1): checked at the boundary
as vLLM's own OpenAI server makes them fit for JSON. A logprob below -9999.0 (-inf: a token
of probability 0) is clamped to -9999.0 as vLLM does; NaN, +inf or a field of the wrong type
is the PD's invalid answer (a 502 charged to it, a stream's error frame), never a 500 from
the JSON encoder. A stream carries the PD's logprobs when the client asked, as the
non-streaming answer does."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from epd_kit.router.app import create_app
from epd_kit.router_yaml import parse_config
from tests.unit.router import scripted_engines

INF = float("inf")
NAN = float("nan")
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 1}


def entry(token_id: int, logprob: object, top: object = None) -> dict:
    """One position of vLLM 0.24's PD logprobs (serve/disagg/serving.py _create_tokens_logprobs)."""
    top = [{"token": f"token_id:{token_id}", "logprob": logprob}] if top is None else top
    return {"token": f"token_id:{token_id}", "logprob": logprob, "bytes": None, "top_logprobs": top}


class Pds:
    """Every PD answers 'Hi' (ids 72, 105) with `logprobs` (json.dumps writes NaN, Infinity)."""

    def __init__(self) -> None:
        self.logprobs: object = None
        self.calls = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        self.calls += 1
        rid = body["request_id"]
        if not body.get("stream"):
            choice = {"index": 0, "token_ids": [72, 105], "finish_reason": "stop", "logprobs": self.logprobs}
            doc = {"request_id": rid, "choices": [choice]}
            return httpx.Response(200, content=json.dumps(doc), headers={"content-type": "application/json"})
        frames = [
            {"request_id": rid, "choices": [{"index": 0, "token_ids": [72], "logprobs": self.logprobs}]},
            {"request_id": rid, "choices": [{"index": 0, "token_ids": [105], "finish_reason": "stop"}]},
        ]
        sse = b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})


@pytest.fixture
async def router(config, char_renderer):
    pds = Pds()
    doc = config(retries={"max_attempts": 2}, health={"failure_threshold": 100, "failure_ratio": 1.0})
    logical = [e["url"] for pool in doc["endpoints"].values() for e in pool]
    async with scripted_engines.serve(pds.handler, logical) as real:
        for pool in doc["endpoints"].values():
            for e in pool:
                e["url"] = real[e["url"]]
        app = create_app(parse_config(doc), char_renderer())
        service = app.state.service
        await service.start()
        for e in service.state.pools.all():
            e.healthy = True
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            yield pds, client, service
        await service.stop()


def pd_failures(service) -> float:
    registry = service.metrics.registry
    return sum(
        registry.get_sample_value("epd_router_engine_failures_total", {"engine": pd, "role": "pd"}) or 0.0
        for pd in ("epd-pd-0", "epd-pd-1")
    )


def stream_docs(text: str) -> list[dict]:
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True])
async def test_minus_infinity_is_clamped_as_vllm_does(router, stream):
    pds, client, service = router
    pds.logprobs = {"content": [entry(72, -INF, [{"token": "token_id:72", "logprob": -1e6, "bytes": [72]}])]}
    r = await client.post("/v1/chat/completions", json={**BODY, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        docs = stream_docs(r.text)
        assert r.text.endswith("data: [DONE]\n\n") and not any("error" in d for d in docs)
        logprobs = docs[0]["choices"][0]["logprobs"]
        assert docs[1]["choices"][0]["logprobs"] is None  # asked, none for that chunk
    else:
        logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs == {
        "content": [
            {
                "token": "token_id:72",
                "logprob": -9999.0,
                "bytes": None,
                "top_logprobs": [{"token": "token_id:72", "logprob": -9999.0, "bytes": [72]}],
            }
        ]
    }
    assert pd_failures(service) == 0


async def test_a_stream_has_no_logprobs_unless_asked(router):
    pds, client, _ = router
    pds.logprobs = {"content": [entry(72, -0.5)]}
    r = await client.post(
        "/v1/chat/completions", json={**BODY, "logprobs": False, "top_logprobs": None, "stream": True}
    )
    assert r.status_code == 200 and all("logprobs" not in d["choices"][0] for d in stream_docs(r.text))


BAD = {
    "NaN": {"content": [entry(72, NAN)]},
    "+inf": {"content": [entry(72, INF)]},
    "NaN in top_logprobs": {"content": [entry(72, -0.5, [{"token": "token_id:72", "logprob": NAN}])]},
    "null logprob": {"content": [entry(72, None)]},
    "string logprob": {"content": [entry(72, "-0.5")]},
    "bool logprob": {"content": [entry(72, True)]},
    "token not a string": {"content": [{**entry(72, -0.5), "token": 72}]},
    "bytes not bytes": {"content": [{**entry(72, -0.5), "bytes": [300]}]},
    "content not a list": {"content": {"token": "x"}},
    "not an object": [1, 2],
    "top_logprobs not a list": {"content": [entry(72, -0.5, "x")]},
}


@pytest.mark.parametrize("logprobs", list(BAD.values()), ids=list(BAD))
async def test_non_finite_or_mistyped_logprobs_are_the_pds_invalid_answer(router, logprobs):
    """They used to reach the JSON encoder (allow_nan=False): a 500 for NaN and infinities."""
    pds, client, service = router
    pds.logprobs = logprobs
    r = await client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"] == "the engine sent an invalid answer"
    assert pds.calls == 2 and pd_failures(service) == 2  # retried on the other PD, both charged

    r = await client.post("/v1/chat/completions", json={**BODY, "stream": True})
    assert r.status_code == 200
    error = stream_docs(r.text)[-1]["error"]
    assert error["code"] == 502 and error["message"] == "the engine sent an invalid answer"
    assert "[DONE]" not in r.text and pd_failures(service) == 3
    assert not any(isinstance(v, float) and not math.isfinite(v) for v in _numbers(stream_docs(r.text)))


def _numbers(doc: object):
    if isinstance(doc, dict):
        for v in doc.values():
            yield from _numbers(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _numbers(v)
    else:
        yield doc
