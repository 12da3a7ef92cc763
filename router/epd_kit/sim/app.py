"""HTTP surface of a simulated engine: the routes `vllm serve` has that the kit uses."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..asgi import app as asgi_app
from ..asgi import route
from ..wire import (
    ENGINE_DEAD_MESSAGE,
    GENERATE_PATH,
    SSE_DONE,
    ErrorInfo,
    ErrorResponse,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    StreamChoice,
    StreamChunk,
    Usage,
    server_request_id,
    sse_frame,
    stream_request_id,
)
from .config import VLLM_VERSION, EngineConfig
from .errors import EngineDeadError, InputRejected, RequestRejected
from .faults import FaultInjector, Faults
from .metrics import SimMetrics
from .pd import PrefillDecodeEngine, Sequence, build_sequence
from .profile import LatencyProfile
from .release import GENERATION_ERROR, SCALE_OUT_DISABLED, AnswerShape, answer_shape
from .tracing import SimTracer, untraced
from .ve import VisionEncoderEngine

log = logging.getLogger("epd_sim.api")


def error_response(message: str, status: int, err_type: str) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, code=status))
    return JSONResponse(body.model_dump(exclude={"request_id"}), status_code=status)


class SimEngine:
    """Everything one engine process owns: config, role engine, metrics, faults, liveness."""

    def __init__(
        self,
        cfg: EngineConfig,
        profile: LatencyProfile,
        faults: Faults,
        seed: int = 0,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.profile = profile
        self.metrics = SimMetrics(cfg.served_model_name, cfg.engine_id)
        self.injector = FaultInjector(faults, seed)
        self._on_dead = on_dead
        self.created = int(time.time())
        self.answers = answer_shape()  # the vLLM it answers as (EPD_SIM_VLLM)
        self.ve: VisionEncoderEngine | None = None
        self.pd: PrefillDecodeEngine | None = None
        if cfg.role == "ve":
            self.ve = VisionEncoderEngine(cfg, profile, self.metrics, faults, self.answers)
        else:
            self.pd = PrefillDecodeEngine(cfg, profile, self.metrics, self._dead, lambda: self.faults)

    @property
    def faults(self) -> Faults:
        return self.injector.faults

    def set_faults(self, faults: Faults) -> None:
        self.injector.faults = faults
        if self.ve:
            self.ve.faults = faults

    @property
    def is_dead(self) -> bool:
        return bool(self.pd and self.pd.dead is not None)

    def _dead(self, exc: BaseException) -> None:
        if self._on_dead:
            self._on_dead(exc)

    async def start(self) -> None:
        await (self.ve.start() if self.ve else self.pd.start())  # type: ignore[union-attr]

    async def stop(self) -> None:
        await (self.ve.stop() if self.ve else self.pd.stop())  # type: ignore[union-attr]


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(engine: SimEngine, tracer: SimTracer | None = None) -> Starlette:
    """`tracer`: --otlp-traces-endpoint's (tracing.py); None: tracing off."""
    cfg = engine.cfg

    async def health(request: Request) -> Response:
        return Response(status_code=503 if engine.is_dead else 200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VLLM_VERSION})

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.served_model_name,
                        "object": "model",
                        "created": engine.created,
                        "owned_by": "vllm",
                        "root": cfg.model,
                        "parent": None,
                        "max_model_len": cfg.max_model_len,
                    }
                ],
            }
        )

    async def metrics(request: Request) -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    async def get_faults(request: Request) -> Response:
        return JSONResponse(engine.faults.model_dump())

    async def put_faults(request: Request) -> Response:
        try:
            faults = Faults.model_validate_json(await request.body())
        except ValidationError as exc:
            return error_response(str(exc), 400, "BadRequestError")
        engine.set_faults(faults)
        log.warning("fault injection changed: %s", faults.model_dump(exclude_defaults=True))
        return JSONResponse(faults.model_dump())

    async def generate(request: Request) -> Response:
        raw = await request.body()
        verdict = engine.injector.admit()
        if verdict:
            engine.metrics.fault(verdict)
        if verdict == "crash":
            log.critical("simulated crash (fault crash_after=%s)", engine.faults.crash_after)
            logging.shutdown()
            os._exit(1)
        if verdict == "hang":
            await _wait_disconnect(request)
            return Response(status_code=499)
        await engine.injector.delay()
        if verdict == "error":
            return error_response("simulated internal error (epd-sim fault injection)", 500, "InternalServerError")
        try:
            req = GenerateRequest.model_validate_json(raw)
        except ValidationError as exc:
            return error_response(f"invalid request body: {exc}", 400, "BadRequestError")
        request_id = req.request_id or uuid.uuid4().hex
        trace = tracer.request(request.headers, req, request_id, cfg.max_model_len) if tracer else None
        try:
            if engine.ve is not None:
                resp = await engine.ve.generate(req, trace)
                body = engine.answers.answer(resp, request_id, cfg.served_model_name, len(req.token_ids))
                return Response(body, media_type="application/json")
            assert engine.pd is not None
            seq = build_sequence(req, cfg, request_id, engine.answers.handoff)
            seq.trace = trace
            seq.fail_after = engine.injector.generation_error()
            if seq.fail_after is not None:
                engine.metrics.fault("generation_error")
            engine.pd.submit(seq)
        except InputRejected as exc:
            if not (req.stream and engine.pd is not None):
                return error_response(exc.message, exc.status, exc.err_type)
            frame = {"error": {"message": exc.message, "type": exc.err_type, "param": None, "code": exc.status}}
            return StreamingResponse(iter((sse_frame(frame), SSE_DONE)), media_type="text/event-stream")
        except RequestRejected as exc:
            return error_response(exc.message, exc.status, exc.err_type)
        except EngineDeadError as exc:  # a request that came after the engine core died
            return error_response(str(exc), 500, "InternalServerError")
        if req.stream:
            include_usage = req.stream_options is not None and (req.stream_options.include_usage is not False)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            return StreamingResponse(
                _stream(engine.pd, seq, include_usage, continuous, engine.answers),
                media_type="text/event-stream",
            )
        return await _complete(engine.pd, seq, request, engine.answers, cfg.served_model_name)

    routes = [
        route("/health", health, ["GET"]),
        route("/version", version, ["GET"]),
        route("/v1/models", models, ["GET"]),
        route("/metrics", metrics, ["GET"]),
        route("/sim/faults", get_faults, ["GET"]),
        route("/sim/faults", put_faults, ["PUT"]),
    ]
    if engine.answers.scale_out_opt_in and not cfg.enable_scale_out:

        async def scale_out_disabled(request: Request) -> Response:
            return error_response(SCALE_OUT_DISABLED, 403, "PermissionDeniedError")

        # vLLM >= 0.30 without --enable-scale-out: the route is there and refuses (release.py)
        log.info("%s", SCALE_OUT_DISABLED)
        return asgi_app([*routes, route(GENERATE_PATH, scale_out_disabled, ["POST"])])
    return asgi_app([*routes, route(GENERATE_PATH, untraced(generate) if tracer is None else generate, ["POST"])])


def _engine_error(seq: Sequence) -> tuple[str, int]:
    """What a request in flight when the engine core died is answered: vLLM's EngineDeadError
    message, never the cause (`seq.error`), which only the log has (docs/sim.md "Real vLLM")."""
    return ENGINE_DEAD_MESSAGE, 500


async def _complete(
    pd: PrefillDecodeEngine, seq: Sequence, request: Request, answers: AnswerShape, model: str
) -> Response:
    waiter = asyncio.ensure_future(seq.wait_done())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not waiter.done():
        waiter.cancel()
        pd.abort(seq)  # client went away: free the slot
        return Response(status_code=499)
    if seq.error is not None:
        message, status = _engine_error(seq)
        return error_response(message, status, "InternalServerError")
    if seq.finish_reason == "abort":
        return error_response("request aborted (engine shutting down)", 503, "ServiceUnavailable")
    if seq.finish_reason == "error" and answers.generation_error_is_500:
        return JSONResponse({"error": GENERATION_ERROR}, status_code=500)  # else 0.24's 200 with that choice
    tokens = list(seq.plan.token_ids[: seq.emitted]) if seq.plan else []
    body = GenerateResponse(
        request_id=server_request_id(),
        choices=[GenerateChoice(index=0, finish_reason=seq.finish_reason, token_ids=tokens)],
    )
    answer = answers.answer(body, seq.request_id, model, len(seq.prompt_ids))
    return Response(answer, media_type="application/json")


def token_frame(request_id_json: str, tokens: list[int], finish: str | None, choice_tail: str = "") -> bytes:
    """`sse_frame(StreamChunk(...))` for a plain token chunk (docs/contract.md §3.3), without pydantic;
    choice_tail: the members a vLLM adds after `routed_experts` (AnswerShape.stream_choice_tail)."""
    fin = "null" if finish is None else json.dumps(finish)
    ids = ",".join(map(str, tokens))
    return (
        f'data: {{"request_id":{request_id_json},"choices":[{{"index":0,"logprobs":null,'
        f'"finish_reason":{fin},"token_ids":[{ids}],"routed_experts":null{choice_tail}}}],"usage":null}}\n\n'
    ).encode()


async def _stream(
    pd: PrefillDecodeEngine, seq: Sequence, include_usage: bool, continuous: bool, answers: AnswerShape
) -> AsyncIterator[bytes]:
    prompt = len(seq.prompt_ids)
    frame_id = stream_request_id(seq.request_id)
    rid_json = json.dumps(frame_id)
    try:
        while True:
            await seq.event.wait()
            seq.event.clear()
            tokens = seq.take()
            # generation failed for this request: the tokens before it, then vLLM's error event
            failed = seq.done and seq.finish_reason == "error"
            if seq.error is not None:
                message, status = _engine_error(seq)
                yield sse_frame(
                    {"error": {"message": message, "type": "InternalServerError", "param": None, "code": status}}
                )
                break
            if tokens:
                finish = seq.finish_reason if seq.done and not failed else None
                if continuous:
                    usage = Usage(
                        prompt_tokens=prompt, completion_tokens=seq.emitted, total_tokens=prompt + seq.emitted
                    )
                    yield sse_frame(
                        StreamChunk(
                            request_id=frame_id,
                            choices=[
                                StreamChoice(
                                    index=0, finish_reason=finish, token_ids=tokens, **answers.stream_choice_extra()
                                )
                            ],
                            usage=usage,
                        )
                    )
                else:  # the hot path of a busy PD: same bytes as the model dump, built directly
                    yield token_frame(rid_json, tokens, finish, answers.stream_choice_tail)
            if failed:
                yield sse_frame({"error": GENERATION_ERROR})
                break
            if seq.done:
                if include_usage and seq.finish_reason in ("stop", "length"):
                    usage = Usage(
                        prompt_tokens=prompt, completion_tokens=seq.emitted, total_tokens=prompt + seq.emitted
                    )
                    yield sse_frame(StreamChunk(request_id=frame_id, usage=usage), exclude_none=True)
                break
        yield SSE_DONE
    finally:
        pd.abort(seq)  # no-op when finished; frees the slot on client disconnect
