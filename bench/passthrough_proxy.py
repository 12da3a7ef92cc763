"""The floor for router overhead: a proxy that does only the two engine HTTP hops.

Same stack as epd-router (starlette under uvicorn with httptools and uvloop, one
aiohttp.ClientSession to the engines), none
of its work (no chat template, tokenization, image preprocessing, placement, health,
detokenization, OpenAI shaping). The client sends it already-rendered engine bodies:

  POST /text   body = the PD `/inference/v1/generate` body; forwarded byte for byte.
  POST /image  header x-ve-length: N; body = N bytes of VE body + the PD body.
               The VE body is forwarded byte for byte; the VE's locators are put into the
               PD body (docs/contract.md §3.1) and the PD answer is returned.

    python -m bench.passthrough_proxy --ve-url http://127.0.0.1:P --pd-url http://127.0.0.1:Q --port R
"""

from __future__ import annotations

import argparse
import json
from contextlib import asynccontextmanager

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

GENERATE = "/inference/v1/generate"
JSON_HEADERS = {"content-type": "application/json"}


def build_app(ve_url: str, pd_url: str) -> Starlette:
    sessions: list[aiohttp.ClientSession] = []

    @asynccontextmanager
    async def lifespan(app: Starlette):
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=120)
        sessions.append(aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)))
        yield
        await sessions[0].close()

    async def post(url: str, body: bytes) -> tuple[int, bytes]:
        async with sessions[0].post(url + GENERATE, data=body, headers=JSON_HEADERS) as r:
            return r.status, await r.read()

    async def health(request: Request) -> Response:
        return Response(b"ok")

    async def text(request: Request) -> Response:
        status, answer = await post(pd_url, await request.body())
        return Response(answer, status_code=status, media_type="application/json")

    async def image(request: Request) -> Response:
        body = await request.body()
        n = int(request.headers["x-ve-length"])
        status, ve = await post(ve_url, body[:n])
        if status != 200:
            return Response(ve, status_code=502, media_type="application/json")
        locators = json.loads(ve)["kv_transfer_params"]["ec_locator"]
        pd_body = json.loads(body[n:])
        extra = pd_body["sampling_params"].setdefault("extra_args", {})
        extra["kv_transfer_params"] = {"ec_locator": locators}
        status, answer = await post(pd_url, json.dumps(pd_body).encode())
        return Response(answer, status_code=status, media_type="application/json")

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/text", text, methods=["POST"]),
            Route("/image", image, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.passthrough_proxy", description=__doc__.split("\n")[0])
    ap.add_argument("--ve-url", required=True)
    ap.add_argument("--pd-url", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    uvicorn.run(
        build_app(args.ve_url, args.pd_url), host=args.host, port=args.port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
