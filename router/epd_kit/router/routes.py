"""The HTTP surface: the OpenAI routes, the operations endpoints and the error handlers, over
the app's one `RouterService` (`app.state.service`)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Router

from epd_kit.asgi import route
from epd_kit.preprocess.fairness import client_identity, current_client
from epd_kit.preprocess.settings import Limits
from epd_kit.router import tracing
from epd_kit.router.body import decode_body
from epd_kit.router.context import RequestContext
from epd_kit.router.errors import RouterError
from epd_kit.router.generation import GapWatch, Generation
from epd_kit.router.intake import ClientGone, IntakeSlot, read_body
from epd_kit.router.listener import CLIENT_GONE, DisconnectSignal
from epd_kit.router.metrics import RequestOutcome
from epd_kit.router.openai_api import ChatCompletionRequest, parse_request
from epd_kit.router.service import RouterService
from epd_kit.router.tenants import Ticket, count_images

log = logging.getLogger("epd_router.app")

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:+=@-]{1,128}$")

T = TypeVar("T")

CHAT_PATH = "/v1/chat/completions"


def _service(request: Request) -> RouterService:
    return request.app.state.service


def _check_key(request: Request, protected: bool = True) -> str | None:
    """Refuses a request without a valid key (when keys are on); the key's tenant, if any."""
    # two Authorization headers: which one names the client is ambiguous (the first used to
    # win), so the request is refused whether or not keys are checked
    if len(request.headers.getlist("authorization")) > 1:
        raise RouterError(400, "more than one Authorization header: send exactly one 'Authorization: Bearer <key>'")
    return _service(request).auth.check(request.headers.get("authorization")) if protected else None


def _check_operator(request: Request, protected: bool) -> None:
    """/metrics and /pools: the admin token, or a peer in admin.networks (then the API key
    too when auth protects the endpoint, as before); anyone else is told there is no such
    route, the 404 of a path that does not exist (admin.py)."""
    if len(request.headers.getlist("authorization")) > 1:
        raise RouterError(400, "more than one Authorization header: send exactly one 'Authorization: Bearer <key>'")
    admin = _service(request).admin
    if admin.by_token(request.headers.get("authorization")):
        return
    peer = request.client
    if not admin.by_address(peer.host if peer else None):
        raise RouterError(404, f"no route {request.url.path}")
    _check_key(request, protected)


# --- OpenAI surface ---------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    """Every outcome is counted once (`RequestOutcome`) and answered with the request id: a
    `RouterError` as its envelope, anything else as a 500 envelope (a router bug, logged with
    its traceback), a client that left as a quiet 499. app.py calls it directly, outside
    Starlette's routing and error handlers."""
    service = _service(request)
    outcome = service.metrics.track_request()
    given = request.headers.get("x-request-id")
    rid = _request_id(request)
    slot: IntakeSlot | None = None
    ticket: Ticket | None = None  # the tenant's admission, given back with the tokens used
    tokens = 0
    try:
        if given is not None and rid != given:
            raise RouterError(400, "x-request-id must be 1-128 characters of [A-Za-z0-9._:+=@-]")
        tenant = _check_key(request)
        if tenant is not None:  # before the body: a refused tenant costs no upload or work
            ticket = await service.tenants.admit(tenant)
        limits = service.state.cfg.limits
        # admitted once the body is in: a slow or stalled upload costs its own connection
        # (bounded by listen.body_timeout_s and listen.max_connections), never others' slots
        receiving_cap = limits.max_requests_preprocessing * limits.max_body_bytes
        with tracing.span("receive"):
            body = await read_body(request, limits.max_body_bytes, service.intake, receiving_cap)
            slot = service.intake.enter(limits.max_requests_preprocessing)
            current_client.set(_client_of(request, service.auth.enabled))
            chat, inline = await _decode(service, body)
        lane = service.lane_for(chat.model)  # several models: by the body's `model` (404 if unknown)
        outcome.model = lane.name  # counted under a served name from here on, never the client's string
        if ticket is not None:
            await ticket.images(count_images(chat.messages))
        del body  # `inline` keeps the image payloads' bytes until they are rendered
        ctx = RequestContext.start(chat, rid, lane.state.cfg, intake=slot, inline=inline)
        if chat.stream:
            response = await _stream(request, service, lane.generation, ctx, outcome, ticket)
            if isinstance(response, _CleanupStreamingResponse):
                ticket = None  # the stream gives it back as it ends
            else:  # the client left before the first token: the engines had its prompt
                tokens = len(ctx.token_ids)
            return response
        service.begin_request()
        work = lane.generation.complete(ctx)
        if ticket is not None and ticket.limits.tokens_per_min is not None:
            # a client that leaves is charged what the PD generates: the call runs on (bounded
            # by max_tokens and the deadline) instead of being aborted, its usage unknown
            work = service.keep(asyncio.ensure_future(work))
        try:
            result = await _race_disconnect(request, asyncio.shield(work) if isinstance(work, asyncio.Task) else work)
        finally:
            if isinstance(work, asyncio.Task) and not work.done():
                work.add_done_callback(functools.partial(_charge_when_done, service, ticket, ctx))
                ticket = None
            else:
                service.end_request()
        if result is not None:
            tokens = result["usage"]["total_tokens"]
        elif isinstance(work, asyncio.Task):  # the client left as the PD answered
            tokens = _used(work, ctx)
        else:  # the client left: the engines had its prompt
            tokens = len(ctx.token_ids)
    except ClientGone:
        return _client_left(outcome, rid, "during upload")
    except RouterError as err:
        return _failed(outcome, rid, err)
    except Exception:
        log.exception("internal error", extra={"request_id": rid})
        return _failed(outcome, rid, RouterError(500, "internal error in the router (see its log)"))
    finally:
        if slot is not None:
            slot.release()
        if ticket is not None:
            ticket.finish(tokens)
    if result is None:  # client went away; nobody reads this
        return _client_left(outcome, rid, "before the answer")
    outcome.first_byte()
    outcome.record("200")
    duration = round(time.monotonic() - outcome.started, 4)
    log.info(
        "request done",
        extra={"request_id": rid, "engine_request_id": ctx.engine_request_id, "status": 200, "duration_s": duration},
    )
    return Response(_answer_json(result).encode(), headers={"x-request-id": rid}, media_type="application/json")


# what JSONResponse renders (the same bytes and headers), without an encoder built per answer
_answer_json = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def _charge_when_done(service: RouterService, ticket: Ticket | None, ctx: RequestContext, work: asyncio.Task) -> None:
    """A non-streaming request whose client left: its tenant is charged the PD's answer (or
    the prompt, if the call failed) once the call ends."""
    service.end_request()
    tokens = _used(work, ctx)
    if ticket is not None:
        ticket.finish(tokens)
    log.info(
        "the PD's answer to a client that left, charged to its tenant",
        extra={"request_id": ctx.request_id, "tenant": ticket.tenant if ticket else None, "tokens": tokens},
    )


def _used(work: asyncio.Task, ctx: RequestContext) -> int:
    """The tokens of an ended PD call: its usage, or the prompt alone if it failed."""
    if work.cancelled() or work.exception() is not None:
        return len(ctx.token_ids)
    return work.result()["usage"]["total_tokens"]


def _client_of(request: Request, keys_checked: bool) -> str:
    """Whose request this is, for the per-client bound on image work: its API key when the
    router checks keys (an unchecked header is no identity), else its address."""
    peer = request.client
    return client_identity(request.headers.get("authorization"), keys_checked, peer.host if peer else None)


# Bodies up to this size are decoded on the event loop (well under a millisecond); bigger ones
# in a worker thread, so a large or hostile body never holds up other requests.
INLINE_DECODE_BYTES = 32 * 1024


async def _decode(service: RouterService, body: bytearray) -> tuple[ChatCompletionRequest, dict[str, memoryview]]:
    limits = service.state.cfg.limits
    if len(body) <= INLINE_DECODE_BYTES:
        return _decode_now(body, limits)
    return await asyncio.get_running_loop().run_in_executor(service.decode_pool, _decode_now, body, limits)


def _decode_now(body: bytearray, limits: Limits) -> tuple[ChatCompletionRequest, dict[str, memoryview]]:
    decoded = decode_body(body, limits)
    return parse_request(decoded.doc), decoded.inline


def _failed(outcome: RequestOutcome, rid: str, err: RouterError) -> Response:
    outcome.record(str(err.status))
    level = logging.WARNING if err.status >= 500 or err.status == 429 else logging.INFO
    log.log(level, "request failed", extra={"request_id": rid, "status": err.status, "error": err.message})
    return err.response(rid)


def _client_left(outcome: RequestOutcome, rid: str, when: str) -> Response:
    outcome.record("client_closed")
    log.info(f"client left {when}", extra={"request_id": rid, "status": 499})
    return Response(status_code=499)


async def _stream(
    request: Request,
    service: RouterService,
    generation: Generation,
    ctx: RequestContext,
    outcome: RequestOutcome,
    ticket: Ticket | None,
) -> Response:
    service.begin_request()  # ended by the response, whatever happens to it
    try:
        pd = await _race_disconnect(request, generation.open_stream(ctx))
    except BaseException:
        service.end_request()
        raise
    if pd is None:
        service.end_request()
        return _client_left(outcome, ctx.request_id, "before the answer")

    async def finished() -> None:
        await generation.close(pd, ctx)
        service.end_request()
        if ticket is not None:  # what the client got: the prompt and the tokens relayed
            ticket.finish(len(ctx.token_ids) + ctx.completion_tokens)
        outcome.record()  # the status `relay` left, or client_closed if it never ran

    return _CleanupStreamingResponse(
        generation.relay(ctx, pd, outcome),
        finished,
        service.state.cfg.listen.idle_timeout_s,
        ctx.request_id,
        media_type="text/event-stream",
        headers={"x-request-id": ctx.request_id, "Cache-Control": "no-cache"},
    )


async def models(request: Request) -> JSONResponse:
    _check_key(request)
    return JSONResponse({"object": "list", "data": [lane.card() for lane in _service(request).lanes.values()]})


# --- operations -------------------------------------------------------------------------------


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> JSONResponse:
    """Ready when every model's lane is (`?model=NAME`: that model's alone; an unknown one is
    the 404 of a request naming it)."""
    service = _service(request)
    model = request.query_params.get("model")
    lanes = [service.lanes[model] if model in service.lanes else service.lane_for(model)] if model else None
    lanes = lanes or list(service.lanes.values())
    waiting = [lane for lane in lanes if not lane.state.ready]
    if not waiting:
        return JSONResponse({"ready": True})
    reasons = [lane.state.not_ready_reason() for lane in waiting]
    if service.several and not service.state.draining:
        reasons = [f"{lane.name}: {reason}" for lane, reason in zip(waiting, reasons, strict=True)]
    return JSONResponse(
        {"ready": False, "reason": "; ".join(dict.fromkeys(reasons))},
        status_code=503,
        headers={"Retry-After": str(round(waiting[0].state.retry_after_s()))},
    )


async def healthcheck(request: Request) -> JSONResponse:
    service = _service(request)
    lanes = list(service.lanes.values())
    body = {
        "status": "ok" if all(lane.state.ready for lane in lanes) else "degraded",
        "ve_instances": sum(len(lane.state.pools.ve) for lane in lanes),
        "pd_instances": sum(len(lane.state.pools.pd) for lane in lanes),
        "ve_healthy": sum(len(lane.state.pools.eligible_ve()) for lane in lanes),
        "pd_healthy": sum(len(lane.state.pools.eligible_pd()) for lane in lanes),
    }
    if service.several:
        body["models"] = {lane.name: "ok" if lane.state.ready else "degraded" for lane in lanes}
    return JSONResponse(body)


async def pools_view(request: Request) -> JSONResponse:
    service = _service(request)
    _check_operator(request, service.state.cfg.auth.protect_pools)
    group = service.metrics.group_engines()
    engines = []
    for index, lane in enumerate(service.lanes.values()):
        for engine in lane.state.pools.all():
            snapshot = engine.snapshot()
            if service.several:  # whose pools it is in (its position in `models`; rollout.py reads it)
                snapshot.update(model=lane.name, model_index=index)
            engines.append(snapshot)
    if group is not None:
        # several processes: a drain or an activation must hold in all of them, not only in
        # the one that happens to answer (docs/router.md "Scale-out")
        for engine in engines:
            view = group.get(engine["id"])
            if view is not None:
                engine.update(inflight=view.inflight, healthy=engine["healthy"] and view.healthy, state=view.state)
    return JSONResponse(
        {
            "ready": all(lane.state.ready for lane in service.lanes.values()),
            "draining": service.state.draining,
            "active_requests": service.active_requests,
            "engines": engines,
        }
    )


async def metrics(request: Request) -> Response:
    service = _service(request)
    _check_operator(request, service.state.cfg.auth.protect_metrics)
    return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")


# Starlette, not FastAPI, routes these (epd_kit/asgi.py says why): every handler reads its
# Request itself, so FastAPI's typed parameters, validation and OpenAPI had nothing to do here
routes = Router(
    [
        route(CHAT_PATH, chat_completions, ["POST"]),  # app.py serves it first; here: 405 for other methods
        route("/v1/models", models, ["GET"]),
        route("/health", health, ["GET"]),
        route("/ready", ready, ["GET"]),
        route("/healthcheck", healthcheck, ["GET"]),
        route("/pools", pools_view, ["GET"]),
        route("/metrics", metrics, ["GET"]),
    ],
    # no 307 to the path with(out) a trailing slash: Starlette builds that Location from
    # the client's Host header; a wrong path is a 404 naming it
    redirect_slashes=False,
)


# --- error handlers ---------------------------------------------------------------------------


def _request_id(request: Request) -> str:
    """The client's id when it is a valid one, else a fresh one: every error carries an id."""
    given = request.headers.get("x-request-id")
    return given if given is not None and REQUEST_ID_RE.match(given) else secrets.token_hex(16)


async def _router_error(request: Request, exc: RouterError) -> Response:
    return exc.response(_request_id(request))


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    path = request.url.path
    messages = {404: f"no route {path}", 405: f"method {request.method} not allowed on {path}"}
    return RouterError(exc.status_code, messages.get(exc.status_code, str(exc.detail))).response(_request_id(request))


async def _internal(request: Request, exc: Exception) -> Response:
    rid = _request_id(request)
    log.exception("internal error", extra={"path": request.url.path, "request_id": rid})
    return RouterError(500, "internal error in the router (see its log)").response(rid)


EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Any], Awaitable[Response]]] = {
    RouterError: _router_error,
    StarletteHTTPException: _http_error,
    Exception: _internal,
}


# --- HTTP plumbing ----------------------------------------------------------------------------


class _CleanupStreamingResponse(StreamingResponse):
    """Runs `cleanup` after the response ends on every path, including a client that left
    before the body started (the generator's own `finally` would then never run).

    A client that takes no byte for `write_timeout_s` (listen.idle_timeout_s) while a frame
    waits for it (it stopped reading: its socket buffers are full) is dropped: the body ends
    as for a client that left (the PD request is aborted and its slot freed, the PD is not
    charged: generation.GapWatch does not count this wait) and uvicorn closes the connection.
    Only a pending write counts, not the wait for the PD's next token."""

    def __init__(
        self, content, cleanup: Callable[[], Awaitable[None]], write_timeout_s: float, request_id: str, **kwargs
    ) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup
        self._write_timeout_s = write_timeout_s
        self._request_id = request_id

    async def __call__(self, scope, receive, send) -> None:
        watch: GapWatch | None = None
        try:
            with anyio.CancelScope() as cancel:
                watch = GapWatch(self._write_timeout_s, cancel.cancel)
                watch.pause()  # counts only while a write is pending

                async def bounded(message) -> None:
                    watch.restart()
                    await send(message)
                    watch.pause()

                await super().__call__(scope, receive, bounded)
            if watch.fired:
                log.info(
                    "client dropped: it took no byte of its stream for listen.idle_timeout_s",
                    extra={"request_id": self._request_id, "status": 499, "idle_timeout_s": self._write_timeout_s},
                )
                signal: DisconnectSignal | None = scope.get(CLIENT_GONE)
                if signal is not None:  # under the router's listener: close without flushing
                    signal.drop()
        finally:
            if watch is not None:
                watch.stop()
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._cleanup()


async def _race_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (which aborts the engine
    request: the engine client closes the connection) and return None.

    `work` runs in the caller's own task. Under the router's listener the disconnect comes
    from the request's `DisconnectSignal` (listener.py), with no task at all; elsewhere (an
    ASGI test transport) a watcher task waits on `receive()`: a second task per request and
    `asyncio.wait` cost more CPU than the rest of this race. Either cancels the caller only
    while the caller still awaits `work`."""
    caller = asyncio.current_task()
    assert caller is not None, "_race_disconnect runs in a task"
    race = _Race()

    def left() -> None:
        if not race.finished:
            race.client_left = True
            caller.cancel()

    signal: DisconnectSignal | None = request.scope.get(CLIENT_GONE)
    watcher: asyncio.Future[None] | None = None
    if signal is not None:
        signal.watch(left)
    else:

        async def disconnected() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    left()
                    return

        watcher = asyncio.ensure_future(disconnected())
    try:
        result = await work
    except BaseException:
        race.finished = True
        if not race.client_left:
            raise
        caller.uncancel()  # our own cancel: the client left, nobody reads what work raised
        return None
    finally:
        race.finished = True
        if signal is not None:
            signal.unwatch()
        else:
            assert watcher is not None
            watcher.cancel()
    if race.client_left:  # work ended just as the client left (our cancel came too late)
        caller.uncancel()
        return None
    return result


class _Race:
    """What `_race_disconnect`'s watcher and caller tell each other."""

    __slots__ = ("client_left", "finished")

    def __init__(self) -> None:
        self.finished = False
        self.client_left = False
