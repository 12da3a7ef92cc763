"""The floor for router overhead: a proxy that does only the two engine HTTP hops.

Same stack as epd-router (starlette under uvicorn, httpx.AsyncClient to the engines), none
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

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

GENERATE = "/inference/v1/generate"
JSON_HEADERS = {"content-type": "application/json"}


def build_app(ve_url: str, pd_url: str) -> Starlette:
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        clients["ve"] = httpx.AsyncClient(base_url=ve_url, timeout=60, limits=limits)
        clients["pd"] = httpx.AsyncClient(base_url=pd_url, timeout=60, limits=limits)
        yield
        for c in clients.values():
            await c.aclose()

    async def health(request: Request) -> Response:
        return Response(b"ok")

    async def text(request: Request) -> Response:
        body = await request.body()
        r = await clients["pd"].post(GENERATE, content=body, headers=JSON_HEADERS)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def image(request: Request) -> Response:
        body = await request.body()
        n = int(request.headers["x-ve-length"])
        ve = await clients["ve"].post(GENERATE, content=body[:n], headers=JSON_HEADERS)
        if ve.status_code != 200:
            return Response(ve.content, status_code=502, media_type="application/json")
        locators = ve.json()["kv_transfer_params"]["ec_locator"]
        pd_body = json.loads(body[n:])
        extra = pd_body["sampling_params"].setdefault("extra_args", {})
        extra["kv_transfer_params"] = {"ec_locator": locators}
        r = await clients["pd"].post(GENERATE, content=json.dumps(pd_body), headers=JSON_HEADERS)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

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
