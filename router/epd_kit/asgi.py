"""HTTP apps on Starlette with FastAPI's answers: the sim's (`app`) and the router's routes (`route`).

The sim and the router served on FastAPI, as vLLM does, but used nothing FastAPI adds to
Starlette (no typed parameters, no OpenAPI document: every handler reads its Request itself),
and importing FastAPI builds its OpenAPI models: ~0.4 CPU-s of a sim's ~0.9 from its start to a
healthy /health, and of a router's ~1.2 (docs/sandbox.md "Where the CPU goes"). What a client
sees stays FastAPI's: a GET route without Starlette's implicit HEAD, and in the sim 404 and 405
as `{"detail": ...}` JSON (405 with its Allow header), a trailing slash redirected (the router
answers these with its own envelopes, router/routes.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Endpoint = Callable[[Request], Awaitable[Response]]


def route(path: str, endpoint: Endpoint, methods: Sequence[str]) -> Route:
    """A route for exactly `methods`: Starlette adds HEAD to a GET route, FastAPI does not."""
    r = Route(path, endpoint, methods=list(methods))
    r.methods = {m.upper() for m in methods}
    return r


async def _http_error(request: Request, exc: Exception) -> Response:
    """fastapi/exception_handlers.py http_exception_handler: a JSON `detail`, or no body where
    the status allows none."""
    assert isinstance(exc, HTTPException)
    if exc.status_code < 200 or exc.status_code in (204, 205, 304):
        return Response(status_code=exc.status_code, headers=exc.headers)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def app(routes: Sequence[Route]) -> Starlette:
    return Starlette(routes=list(routes), exception_handlers={HTTPException: _http_error})
