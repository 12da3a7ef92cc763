"""Several models behind one router (lanes.py): a request goes to its `model`'s pools, an unknown
model is OpenAI's 404 (model_not_found), /v1/models lists each, /ready answers per model, a
text-only model refuses images with the text-only 400, a reload moves each model's endpoints,
and a one-model config routes as before (any `model`)."""

from __future__ import annotations

import json
import re
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_kit.router.app import create_app
from epd_kit.router.metrics import NO_MODEL, _SharedLiveValues
from epd_kit.router.service import RouterService
from epd_kit.router_yaml import ConfigError, parse_config
from tests.unit.router import scripted_engines

engine_calls: list[str] = []  # the logical URL of each engine that got a generate call


def engines(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/health":
        return httpx.Response(200)
    body = json.loads(request.content)
    engine_calls.append(f"{request.url.scheme}://{request.url.host}:{request.url.port}")
    return httpx.Response(200, json={"request_id": body["request_id"], "choices": [{"token_ids": [72, 105]}]})


def two_models(**extra) -> dict:
    doc = {
        "model": "/models/vision",
        "served_model_name": "vision",
        "models": [{"name": "text", "model": "/models/text", "limits": {"images_per_prompt": 2}}],
        "endpoints": {
            "ve": [{"id": "epd-ve-0", "url": "http://127.0.0.1:11"}],
            "pd": [{"id": "epd-pd-0", "url": "http://127.0.0.1:12"}],
            "models": {"text": {"text_only": True, "pd": [{"id": "epd-text-pd-0", "url": "http://127.0.0.1:21"}]}},
        },
    }
    doc.update(extra)
    return doc


def engine_urls(doc: dict) -> list[tuple[dict, str]]:
    eps = doc["endpoints"]
    lanes = [eps, *eps.get("models", {}).values()]
    return [(e, e["url"]) for lane in lanes for role in ("ve", "pd") for e in lane.get(role, [])]


@pytest.fixture
async def router(char_renderer):
    engine_calls.clear()
    doc = two_models()
    entries = engine_urls(doc)
    async with scripted_engines.serve(engines, [url for _, url in entries]) as real:
        logical = {}
        for entry, url in entries:
            entry["url"] = real[url]
            logical[real[url]] = url
        app = create_app(parse_config(doc), char_renderer())
        service = app.state.service
        await service.start()
        for lane in service.lanes.values():
            for e in lane.state.pools.all():
                e.healthy = True
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            yield client, service, logical
        await service.stop()


def chat(model: str | None, content="hi") -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    if model is not None:
        body["model"] = model
    return body


async def test_each_model_goes_to_its_own_pools(router):
    client, _, _ = router
    for model, engine in (("vision", "http://127.0.0.1:12"), ("text", "http://127.0.0.1:21")):
        engine_calls.clear()
        answer = await client.post("/v1/chat/completions", json=chat(model))
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == model
        assert engine_calls == [engine]
    # by checkpoint too, and no `model`: the first model
    engine_calls.clear()
    assert (await client.post("/v1/chat/completions", json=chat("/models/text"))).status_code == 200
    assert (await client.post("/v1/chat/completions", json=chat(None))).status_code == 200
    assert engine_calls == ["http://127.0.0.1:21", "http://127.0.0.1:12"]


async def test_an_unknown_model_is_openai_404_model_not_found_before_any_engine(router):
    client, _, _ = router
    engine_calls.clear()
    answer = await client.post("/v1/chat/completions", json=chat("nope"))
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found"
    assert error["param"] is None
    assert error["message"].startswith("The model `nope` does not exist") and "vision, text" in error["message"]
    assert engine_calls == []
    stream = await client.post("/v1/chat/completions", json={**chat("nope"), "stream": True})
    assert stream.status_code == 404 and stream.json()["error"]["code"] == "model_not_found"


async def test_v1_models_lists_each_model(router):
    client, _, _ = router
    data = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["root"]) for m in data] == [("vision", "/models/vision"), ("text", "/models/text")]


async def test_ready_per_model(router):
    client, service, _ = router
    assert (await client.get("/ready")).json() == {"ready": True}
    for e in service.lanes["text"].state.pools.pd:
        e.healthy = False
    whole = await client.get("/ready")
    assert whole.status_code == 503 and whole.json()["reason"].startswith("text: no healthy active PD")
    assert (await client.get("/ready", params={"model": "vision"})).status_code == 200
    assert (await client.get("/ready", params={"model": "text"})).status_code == 503
    unknown = await client.get("/ready", params={"model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    # a request for the model that is down says so; the other model still answers
    down = await client.post("/v1/chat/completions", json=chat("text"))
    assert down.status_code == 503
    assert (await client.post("/v1/chat/completions", json=chat("vision"))).status_code == 200
    pools = (await client.get("/pools")).json()
    assert {(e["id"], e["model"]) for e in pools["engines"]} == {
        ("epd-ve-0", "vision"),
        ("epd-pd-0", "vision"),
        ("epd-text-pd-0", "text"),
    }


async def test_a_text_only_model_refuses_images_with_the_text_only_400(router):
    client, _, _ = router
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    answer = await client.post("/v1/chat/completions", json=chat("text", image))
    assert answer.status_code == 400
    assert "text-only" in answer.json()["error"]["message"]


async def test_a_reload_moves_each_models_endpoints(router, tmp_path):
    _, service, _ = router
    doc = two_models()
    doc["endpoints"]["models"]["text"]["pd"].append({"id": "epd-text-pd-1", "url": "http://127.0.0.1:22"})
    doc["endpoints"]["models"]["text"]["pd"][0]["state"] = "draining"
    path = tmp_path / "router.yaml"
    path.write_text(json.dumps(doc))
    service.config_path = path
    assert service.reload()
    text = service.lanes["text"].state.pools
    assert [(e.id, e.state.value) for e in text.pd] == [("epd-text-pd-0", "draining"), ("epd-text-pd-1", "active")]
    assert [e.id for e in service.lanes["vision"].state.pools.pd] == ["epd-pd-0"]


def test_the_config_names_what_is_wrong_with_its_models():
    doc = two_models()
    del doc["endpoints"]["models"]["text"]
    with pytest.raises(ConfigError, match=re.escape("models[0] (text) has no pools: add endpoints.models.text")):
        parse_config(doc)
    doc = two_models(models=[{"name": "vision", "model": "/x"}])
    with pytest.raises(ConfigError, match="served twice"):
        parse_config(doc)
    doc = two_models()
    doc["endpoints"]["models"]["text"]["pd"][0]["id"] = "epd-pd-0"
    with pytest.raises(ConfigError, match="duplicate engine id 'epd-pd-0'"):
        parse_config(doc)
    doc = two_models()
    doc["endpoints"]["models"]["other"] = {"text_only": True, "pd": [{"id": "o", "url": "http://127.0.0.1:9"}]}
    with pytest.raises(ConfigError, match=re.escape("endpoints.models.other: no such model")):
        parse_config(doc)
    assert parse_config(two_models()).lane_config("text").limits.images_per_prompt == 2


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        (two_models(served_model_name=NO_MODEL), "served_model_name"),
        (two_models(served_model_name=None, model="_vision"), "model (the served name without served_model_name)"),
        (two_models(served_model_name=None, model=NO_MODEL), "model (the served name without served_model_name)"),
    ],
)
def test_a_served_name_may_not_be_the_metrics_own_label_value(doc, key):
    """NO_MODEL labels the requests refused before their model was known: a model served under
    that name (or any name starting with '_', kept for such values) would be counted with them."""
    name = doc["served_model_name"] or doc["model"]
    with pytest.raises(ConfigError, match=re.escape(f"{key}: '{name}' starts with '_'")):
        parse_config(doc)


def model_labels(service) -> set[str]:
    """Every value of the `model` label on the router's /metrics page."""
    text = service.metrics.render().decode()
    return {s.labels["model"] for f in text_string_to_metric_families(text) for s in f.samples if "model" in s.labels}


def sample(service, name: str, **labels: str) -> float:
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_metrics_carry_the_served_model_or_none_never_the_clients_string(router):
    """Per model: requests, latency, TTFT and the stage histograms by the lane's served name (a
    request naming the checkpoint, or no model, too); a request refused before its model is
    known (an unknown model, an unreadable body) under `_none`: the label's values are the
    config's names and `_none`, whatever clients send."""
    client, service, _ = router
    for model in ("vision", "text", "/models/text", None):
        assert (await client.post("/v1/chat/completions", json=chat(model))).status_code == 200
    for model in ("nope", "nope\n2"):
        assert (await client.post("/v1/chat/completions", json=chat(model))).status_code == 404
    assert (await client.post("/v1/chat/completions", content=b"{not json")).status_code == 400
    requests = "epd_router_requests_total"
    assert sample(service, requests, status="200", model="vision") == 2
    assert sample(service, requests, status="200", model="text") == 2
    assert sample(service, requests, status="404", model=NO_MODEL) == 2
    assert sample(service, requests, status="400", model=NO_MODEL) == 1
    for histogram in ("request_duration", "time_to_first_token", "preprocess", "pd"):
        for model in ("vision", "text"):
            assert sample(service, f"epd_router_{histogram}_seconds_count", model=model) == 2, (histogram, model)
    assert sample(service, "epd_router_request_duration_seconds_count", model=NO_MODEL) == 3
    healthy = "epd_router_engine_healthy"
    assert sample(service, healthy, engine="epd-text-pd-0", role="pd", model="text") == 1
    assert sample(service, healthy, engine="epd-ve-0", role="ve", model="vision") == 1
    assert model_labels(service) == {"vision", "text", NO_MODEL}


async def test_one_model_routes_any_model_name_as_before(config, char_renderer):
    doc = config()
    entries = engine_urls(doc)
    async with scripted_engines.serve(engines, [url for _, url in entries]) as real:
        for entry, url in entries:
            entry["url"] = real[url]
        app = create_app(parse_config(doc), char_renderer())
        service = app.state.service
        await service.start()
        for e in service.state.pools.all():
            e.healthy = True
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            assert (await client.post("/v1/chat/completions", json=chat("anything"))).status_code == 200
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["/m"]
            # counted under the served name, whatever the request said
            assert model_labels(service) == {"/m"}
            assert "model" not in (await client.get("/pools")).json()["engines"][0]
        await service.stop()


def cache_stats(hits: int, misses: int) -> SimpleNamespace:
    return SimpleNamespace(cache_hits=hits, cache_misses=misses, inflight_joins=0, images_downscaled=0)


def cache_samples(text: str) -> Counter:
    """{(name, model): value} of the preprocess cache counters on a /metrics page."""
    return Counter(
        {
            (s.name, s.labels.get("model")): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("epd_router_preprocess_cache_") and s.name.endswith("_total")
        }
    )


def test_each_models_preprocess_cache_counts_under_its_name(char_renderer):
    """Each lane has its own renderer (its checkpoint's preprocessor and cache): its cache
    counters carry its served name, not the first model's renderer's for the whole router."""
    vision, text = char_renderer(), char_renderer()
    vision.stats, text.stats = cache_stats(3, 1), cache_stats(5, 7)
    service = RouterService(parse_config(two_models()), vision, lane_renderer=lambda cfg: text)
    assert cache_samples(service.metrics.render().decode()) == {
        ("epd_router_preprocess_cache_hits_total", "vision"): 3,
        ("epd_router_preprocess_cache_misses_total", "vision"): 1,
        ("epd_router_preprocess_cache_hits_total", "text"): 5,
        ("epd_router_preprocess_cache_misses_total", "text"): 7,
    }
    # one renderer for every lane (as tests give it) is one cache: counted once, under the first
    shared = char_renderer()
    shared.stats = cache_stats(2, 2)
    service = RouterService(parse_config(two_models()), shared)
    assert cache_samples(service.metrics.render().decode()) == {
        ("epd_router_preprocess_cache_hits_total", "vision"): 2,
        ("epd_router_preprocess_cache_misses_total", "vision"): 2,
    }


def test_shared_preprocess_counters_publish_each_models_increments():
    """Several router processes (multiprocess mode): each publishes its models' cache counters as
    increments since its last publish, per model."""
    from prometheus_client import CollectorRegistry

    stats = {"vision": cache_stats(3, 1), "text": cache_stats(0, 4)}
    registry = CollectorRegistry()
    live = _SharedLiveValues(lambda: SimpleNamespace(all=list), lambda: stats, registry)
    live.publish()
    stats["vision"] = cache_stats(10, 1)
    live.publish()
    live.publish()
    value = registry.get_sample_value
    assert value("epd_router_preprocess_cache_hits_total", {"model": "vision"}) == 10
    assert value("epd_router_preprocess_cache_misses_total", {"model": "vision"}) == 1
    assert value("epd_router_preprocess_cache_misses_total", {"model": "text"}) == 4
    assert value("epd_router_preprocess_cache_hits_total", {"model": "text"}) == 0
