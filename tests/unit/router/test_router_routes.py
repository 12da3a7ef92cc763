"""The chat route's outcomes through the ASGI app (scripted engines): a router bug is a JSON
500 with the request id, counted; bad text is refused before any engine call, also for a
stream; the preprocessing limit answers 429 with Retry-After."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from epd_kit.router.app import create_app
from epd_kit.router.metrics import NO_MODEL
from epd_kit.router_yaml import parse_config
from tests.unit.router import scripted_engines

ENGINE_CALLS: list[str] = []


def engines(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/health":
        return httpx.Response(200)
    body = json.loads(request.content)
    ENGINE_CALLS.append(body["request_id"])
    return httpx.Response(200, json={"request_id": body["request_id"], "choices": [{"token_ids": [72]}]})


class BrokenRenderer:
    """Raises what no handler expects, for one request."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.break_next = False
        self.gate: asyncio.Event | None = None

    async def render(self, messages, **kwargs):
        if self.gate is not None:
            await self.gate.wait()
        if self.break_next:
            self.break_next = False
            raise RuntimeError("a bug")
        return await self.inner.render(messages, **kwargs)

    def detokenize(self, ids, skip_special_tokens=True):
        return self.inner.detokenize(ids, skip_special_tokens)

    def detokenizer(self, *, skip_special_tokens=True):
        return self.inner.detokenizer(skip_special_tokens=skip_special_tokens)


@pytest.fixture
async def app(config, char_renderer):
    ENGINE_CALLS.clear()
    doc = config(limits={"max_requests_preprocessing": 1})
    logical = [e["url"] for pool in doc["endpoints"].values() for e in pool]
    async with scripted_engines.serve(engines, logical) as real:
        for pool in doc["endpoints"].values():
            for e in pool:
                e["url"] = real[e["url"]]
        renderer = BrokenRenderer(char_renderer())
        app = create_app(parse_config(doc), renderer)
        service = app.state.service
        await service.start()
        for e in service.state.pools.all():
            e.healthy = True
        yield app
        await service.stop()


@pytest.fixture
async def client(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        yield c


def requests_total(app, status: str, model: str | None = None) -> float:
    """Requests that ended with `status` under the `model` label (default: the served model)."""
    service = app.state.service
    labels = {"status": status, "model": model or service.state.cfg.model_name}
    return service.metrics.registry.get_sample_value("epd_router_requests_total", labels) or 0.0


BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_a_router_bug_is_a_json_500_with_the_request_id_and_counted(app, client):
    app.state.service.renderer.break_next = True
    r = await client.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "bug-1"})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["request_id"] == "bug-1" and "internal error" in r.json()["error"]["message"]
    assert requests_total(app, "500") == 1
    assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "extra",
    [
        {"model": "\ud800"},
        {"stop": ["\udfff"]},
        {"extra_args": {"k": "\ud800"}},
        {"messages": [{"role": "user", "content": "x\ud800"}]},
    ],
)
async def test_a_lone_surrogate_is_refused_before_any_engine_call(app, client, stream, extra):
    body = json.dumps({**BODY, "stream": stream, **extra})  # json.dumps escapes it as \\udxxx
    r = await client.post("/v1/chat/completions", content=body)
    assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]["message"]
    assert r.json()["request_id"] and ENGINE_CALLS == []
    assert requests_total(app, "400", NO_MODEL) == 1  # refused before its model was known


async def test_the_preprocessing_limit_answers_429_with_retry_after(app, client):
    renderer = app.state.service.renderer
    renderer.gate = asyncio.Event()
    first = asyncio.create_task(client.post("/v1/chat/completions", json=BODY))
    await asyncio.sleep(0.05)
    busy = await client.post("/v1/chat/completions", json=BODY)
    assert busy.status_code == 429 and int(busy.headers["retry-after"]) >= 1
    assert "limits.max_requests_preprocessing" in busy.json()["error"]["message"]
    renderer.gate.set()
    assert (await first).status_code == 200
    assert app.state.service.intake.active == 0
    assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200


async def test_an_invalid_request_id_is_refused_with_a_fresh_one(client):
    r = await client.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "a b"})
    assert r.status_code == 400 and len(r.json()["request_id"]) == 32
    r = await client.get("/nothing")
    assert r.status_code == 404 and r.json()["request_id"]


async def test_a_slow_upload_does_not_take_a_preprocessing_slot(app, client):
    """Uploads trickling their bodies held max_requests_preprocessing for
    the whole body timeout and every other client got 429. Admission now follows the body."""
    arrived = [asyncio.Event() for _ in range(3)]
    finish = [asyncio.Event() for _ in range(3)]

    async def trickle(n: int):
        yield b'{"messages": [{"role": "user", '
        arrived[n].set()
        await finish[n].wait()
        yield b'"content": "hi"}], "max_tokens": 2}'

    slow = [asyncio.create_task(client.post("/v1/chat/completions", content=trickle(n))) for n in range(3)]
    await asyncio.wait_for(asyncio.gather(*(a.wait() for a in arrived)), 5)
    await asyncio.sleep(0.05)
    assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200  # limit is 1
    for n, task in enumerate(slow):  # each, once its body is in, is served like any other
        finish[n].set()
        assert (await task).status_code == 200
    assert app.state.service.intake.active == 0 and app.state.service.intake.receiving_bytes == 0


async def test_no_redirect_is_built_from_the_clients_host(client):
    """POST /v1/chat/completions/ answered 307 to a Location built from
    the client's Host header."""
    r = await client.post("/v1/chat/completions/", json=BODY, headers={"host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers
    assert "no route /v1/chat/completions/" in r.json()["error"]["message"]


async def test_bytes_of_bodies_still_arriving_are_capped_in_all(app, client):
    """Admission after the body must not let uploads hold unbounded memory: the bytes of
    bodies still arriving are capped at max_requests_preprocessing x max_body_bytes (here
    1 x 250), a 503 beyond."""
    state = app.state.service.state
    state.cfg = state.cfg.model_copy(update={"limits": state.cfg.limits.model_copy(update={"max_body_bytes": 250})})
    arrived, finish = asyncio.Event(), asyncio.Event()

    async def trickle():
        yield b'{"messages": [{"role": "user", "content": "' + b"x" * 150
        arrived.set()
        await finish.wait()
        yield b'"}], "max_tokens": 2}'

    slow = asyncio.create_task(client.post("/v1/chat/completions", content=trickle()))
    await asyncio.wait_for(arrived.wait(), 5)
    await asyncio.sleep(0.05)
    partial = b'{"messages": [{"role": "user", "content": "' + b"y" * 60
    other = await client.post("/v1/chat/completions", content=partial)
    assert other.status_code == 503 and "bytes of request bodies are arriving" in other.json()["error"]["message"]
    finish.set()
    assert (await slow).status_code == 200
    assert app.state.service.intake.receiving_bytes == 0


@pytest.fixture
async def text_only_client(config, char_renderer):
    """A text-only fleet's router: no VE, `endpoints.text_only` (the render writes it from the plan)."""
    ENGINE_CALLS.clear()
    doc = config()
    doc["endpoints"] = {"text_only": True, "ve": [], "pd": doc["endpoints"]["pd"]}
    async with scripted_engines.serve(engines, [e["url"] for e in doc["endpoints"]["pd"]]) as real:
        for e in doc["endpoints"]["pd"]:
            e["url"] = real[e["url"]]
        app = create_app(parse_config(doc), char_renderer())
        await app.state.service.start()
        for e in app.state.service.state.pools.all():
            e.healthy = True
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            yield c
        await app.state.service.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_text_only_fleet_is_ready_answers_text_and_refuses_an_image_with_a_400(text_only_client, stream):
    assert (await text_only_client.get("/ready")).json() == {"ready": True}
    r = await text_only_client.post("/v1/chat/completions", json=BODY)  # these scripted PDs do not stream
    assert r.status_code == 200 and len(ENGINE_CALLS) == 1
    image = {"type": "image_url", "image_url": {"url": "http://images.example/cat.png"}}
    content = [{"type": "text", "text": "what is this?"}, image]
    body = {**BODY, "stream": stream, "messages": [{"role": "user", "content": content}]}
    r = await text_only_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages[0].content[1]"
    assert error["message"] == "this fleet is text-only: it has no encoder (VE) for images; send text only"
    assert len(ENGINE_CALLS) == 1  # nothing reached a PD


def test_the_chat_requests_header_lookup_answers_as_starlettes():
    """app._Headers.get skips Mapping.get's KeyError per missing header; every answer is
    starlette's own: any case of the name, the first of repeated ones, the default on a miss."""
    from starlette.datastructures import Headers

    from epd_kit.router.app import _Headers

    raw = [(b"x-request-id", b"abc"), (b"authorization", b"Bearer k1"), (b"authorization", b"Bearer k2")]
    ours, theirs = _Headers(raw=raw), Headers(raw=raw)
    for name in ("x-request-id", "X-Request-ID", "authorization", "AUTHORIZATION", "traceparent", "content-length"):
        assert ours.get(name) == theirs.get(name), name
        assert ours.get(name, "dflt") == theirs.get(name, "dflt"), name
    assert ours.getlist("authorization") == ["Bearer k1", "Bearer k2"]
