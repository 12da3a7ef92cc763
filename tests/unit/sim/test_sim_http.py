"""The sim's HTTP surface answers as vLLM's FastAPI app does, though it runs on Starlette
(epd_kit/asgi.py): 404 and 405 as `{"detail": ...}` JSON, 405 with its Allow header, no implicit
HEAD on a GET route, a trailing slash redirected; the routes' own answers unchanged."""

from __future__ import annotations

import httpx
from sim_args import config, pd_args

from epd_kit.sim import compile_only
from epd_kit.sim.app import SimEngine, create_app
from epd_kit.sim.config import VLLM_VERSION
from epd_kit.sim.faults import Faults
from epd_kit.sim.profile import PROFILES


async def test_the_sim_answers_unknown_paths_and_methods_as_fastapi(tiny_ckpt) -> None:
    engine = SimEngine(config(pd_args(str(tiny_ckpt)), "0-7"), PROFILES["zero"], Faults())
    await engine.start()
    try:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
            missing = await c.get("/nope")
            assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
            for method in ("POST", "DELETE", "OPTIONS", "HEAD"):
                r = await c.request(method, "/health")
                assert (r.status_code, r.headers["allow"]) == (405, "GET"), method
                if method != "HEAD":
                    assert r.json() == {"detail": "Method Not Allowed"}, method
            slash = await c.get("/health/")
            assert (slash.status_code, slash.headers["location"]) == (307, "http://engine/health")
            assert (await c.get("/health")).status_code == 200
            version = await c.get("/version")
            assert (version.content, version.headers["content-type"]) == (
                b'{"version":"%s"}' % VLLM_VERSION.encode(),
                "application/json",
            )
            faults = await c.get("/sim/faults")
            assert faults.json() == Faults().model_dump()
    finally:
        await engine.stop()


async def test_the_cpu_compile_app_refuses_every_other_path_with_its_503() -> None:
    transport = httpx.ASGITransport(app=compile_only.create_app("trn2"))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/version")).json() == {"version": VLLM_VERSION}
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("PUT", "/x/y")):
            r = await c.request(method, path)
            assert r.status_code == compile_only.REFUSAL_STATUS, (method, path)
            assert r.json()["error"]["type"] == "ServiceUnavailableError", (method, path)
