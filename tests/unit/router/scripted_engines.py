"""Scripted engines on real sockets: a test's handler decides what every engine answers (which
real engines cannot be made to do on cue), and the router reaches it over real HTTP on
127.0.0.1 through its own engine client.

Handlers keep the shape of httpx's MockTransport handlers (an `httpx.Request` in, an
`httpx.Response` out, sync or async) and see the engine's logical URL, e.g.
`http://127.0.0.1:11`, so a script can tell engines apart by it; `serve` maps each logical
URL to the real port that serves it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import httpx
from aiohttp import web

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]

# headers aiohttp writes itself for the body it sends
_FRAMING = {"content-length", "transfer-encoding"}


def _relay(handler: Handler, logical: str) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        # the router's headers as sent (the engine key: test_router_engine_keys.py), framing aside
        sent = {k: v for k, v in request.headers.items() if k.lower() not in _FRAMING}
        scripted = httpx.Request(request.method, logical + request.path_qs, content=body, headers=sent)
        answer = handler(scripted)
        if inspect.isawaitable(answer):
            answer = await answer
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in _FRAMING}
        out = web.StreamResponse(status=answer.status_code, headers=headers)
        await out.prepare(request)
        try:
            await out.write(answer.content)
        except httpx.ResponseNotRead:  # a streamed script: sent chunk by chunk, as an engine streams
            async for chunk in answer.aiter_raw():
                await out.write(chunk)
        await out.write_eof()
        return out

    return handle


@contextlib.asynccontextmanager
async def serve(handler: Handler, urls: Iterable[str]) -> AsyncIterator[dict[str, str]]:
    """Serve `handler` for each logical URL on its own 127.0.0.1 port; yields logical URL →
    real URL. Handlers still running at exit (a hung engine) are cancelled."""
    runners: list[web.ServerRunner] = []
    real: dict[str, str] = {}
    try:
        for logical in urls:
            runner = web.ServerRunner(web.Server(_relay(handler, logical)), shutdown_timeout=0.1)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            real[logical] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        yield real
    finally:
        for runner in runners:
            await runner.cleanup()
