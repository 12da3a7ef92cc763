"""The engine key (docs/security.md "Engine keys"): the router sends `Authorization: Bearer <key>`
on the engine paths vLLM checks (/inference/..., never /health), tries the previous key of a
rotation once on a 401 and keeps the one that works, so a rolling change of the engines' key
fails no request; a key no engine takes is a clear 502, logged, never charged to the engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from epd_kit.router.app import create_app
from epd_kit.router.auth import KeyFileError
from epd_kit.router.engine_keys import load_engine_keys
from epd_kit.router_yaml import parse_config
from tests.unit.router import scripted_engines

NEW, OLD = "k-new-7f3a9c", "k-old-2b8c1d"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Engines:
    """Scripted engines that check a key as vLLM does (401 {"error": "Unauthorized"} on
    /inference paths) and record what each request carried."""

    def __init__(self, accepted: str | None) -> None:
        self.accepted = accepted
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        sent = request.headers.get("authorization")
        self.seen.append((request.url.path, sent))
        if request.url.path == "/health":
            return httpx.Response(200)
        if self.accepted is not None and sent != f"Bearer {self.accepted}":
            return httpx.Response(401, json={"error": "Unauthorized"})
        body = json.loads(request.content)
        return httpx.Response(200, json={"request_id": body["request_id"], "choices": [{"token_ids": [72]}]})

    def generate_keys(self) -> list[str | None]:
        # the generate calls' keys (not the probes': /health, and a PD's /v1/models for its context)
        return [auth for path, auth in self.seen if path.startswith("/inference")]


def failures_of(service) -> float | None:
    labels = {"engine": "epd-pd-0", "role": "pd"}
    return service.metrics.registry.get_sample_value("epd_router_engine_failures_total", labels)


def key_file(tmp_path: Path, *keys: str, mode: int = 0o640) -> Path:
    path = tmp_path / "engine-key"
    path.write_text("".join(k + "\n" for k in keys))
    path.chmod(mode)
    return path


@pytest.fixture
async def router(config, char_renderer, tmp_path):
    """(client, service, engines, key path): a router whose key file the test writes."""
    engines = Engines(accepted=NEW)
    doc = config(engine_auth={"key_file": str(key_file(tmp_path, NEW, OLD))})
    doc["endpoints"]["pd"] = doc["endpoints"]["pd"][:1]
    logical = [e["url"] for pool in doc["endpoints"].values() for e in pool]
    async with scripted_engines.serve(engines, logical) as real:
        for pool in doc["endpoints"].values():
            for e in pool:
                e["url"] = real[e["url"]]
        config_path = tmp_path / "router.yaml"
        config_path.write_text(json.dumps(doc))
        app = create_app(parse_config(doc), char_renderer(), config_path=config_path)
        service = app.state.service
        await service.start()
        for e in service.state.pools.all():
            e.healthy = True
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            yield client, service, engines, tmp_path / "engine-key"
        await service.stop()


async def test_the_key_goes_on_engine_requests_and_not_on_health(router):
    client, _service, engines, _ = router
    assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200
    assert engines.generate_keys() == [f"Bearer {NEW}"]
    assert all(auth is None for path, auth in engines.seen if path == "/health")


async def test_a_rotation_fails_no_request(router, caplog):
    client, service, engines, path = router
    # engines still on the old key, the router already holds the new one first
    engines.accepted = OLD
    for _ in range(3):
        assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200
    # one 401 on the new key, then the old one kept: no second refusal
    assert engines.generate_keys() == [f"Bearer {NEW}", f"Bearer {OLD}", f"Bearer {OLD}", f"Bearer {OLD}"]
    assert "trying the other key of engine_auth.key_file" in caplog.text
    # the engine restarts with the new key
    engines.seen.clear()
    engines.accepted = NEW
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200
    assert engines.generate_keys() == [f"Bearer {OLD}", f"Bearer {NEW}", f"Bearer {NEW}"]
    # the rotation ends: the file holds the new key alone, a reload reads it
    key_file(path.parent, NEW)
    assert service.reload()
    engines.seen.clear()
    assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200
    assert engines.generate_keys() == [f"Bearer {NEW}"]
    assert not failures_of(service)


async def test_a_key_no_engine_takes_is_a_clear_502_not_charged(router, caplog):
    client, service, engines, _ = router
    engines.accepted = "another"
    caplog.set_level(logging.INFO)
    r = await client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert message == "the router could not authenticate to the engine (generate)"
    assert NEW not in message and OLD not in message
    logged = " ".join(str(getattr(r, "error", "")) for r in caplog.records)
    assert "refused the router's engine key (HTTP 401): engine_auth.key_file" in logged
    everything = caplog.text + logged + " ".join(str(r.__dict__) for r in caplog.records)
    assert "Bearer" not in everything and NEW not in everything and OLD not in everything  # no key logged
    pd = service.state.pools.pd[0]
    assert pd.healthy  # not ejected: /health would readmit it, a loop
    assert not failures_of(service)


def test_the_key_file_may_be_group_readable_not_world_readable(tmp_path):
    assert load_engine_keys(key_file(tmp_path, "k1", "k0", mode=0o640)) == (b"k1", b"k0")
    with pytest.raises(KeyFileError, match="lets others read it; run: chmod 640"):
        load_engine_keys(key_file(tmp_path, "k1", mode=0o644))
    with pytest.raises(ValueError, match="at most 2"):
        load_engine_keys(key_file(tmp_path, "a", "b", "c"))
    with pytest.raises(KeyFileError, match=r"line 1: .*no spaces") as info:
        load_engine_keys(key_file(tmp_path, "has space"))
    assert "has space" not in str(info.value)  # an error never shows the secret
    assert load_engine_keys(None) == ()
