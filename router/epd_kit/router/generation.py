"""One chat request through the engines: render once, encode on the VEs, then generate on a
PD, as one OpenAI body or as a relayed stream.

A failed PD call moves to another PD only while the client has received nothing: for a
non-streaming request until the answer, for a stream until the PD's first event (read
before the router answers 200). Both paths share one retry loop (`_on_a_pd`). A started
stream that sends no token for `timeouts.stream_gap_s` ends with an error frame, and counts
against its PD (`GapWatch`); the time the relay waits for its client to take a frame is not
the PD's and does not count (a client that stops reading is dropped by routes.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio

from epd_kit.router import bodies, context_window, engine_http, tracing, translate, upstream
from epd_kit.router.admission import PdAdmission
from epd_kit.router.context import RequestContext
from epd_kit.router.encode import Encoder
from epd_kit.router.engine_client import EngineClient, PdStream
from epd_kit.router.errors import EcLoadFailed, EngineDied, GenerationFailed, RouterError, UpstreamError
from epd_kit.router.metrics import RequestOutcome, RouterMetrics
from epd_kit.router.openai_api import ChatCompletionRequest
from epd_kit.router.pools import Engine
from epd_kit.router.rendering import Renderer, render_request
from epd_kit.router.state import RouterState
from epd_kit.router_yaml import EC_READ_GENERATION_ERROR
from epd_kit.wire import EC_LOCATOR, EC_TRANSFER_PARAMS

log = logging.getLogger("epd_router.generation")

T = TypeVar("T")


class Generation:
    def __init__(
        self,
        state: RouterState,
        renderer: Renderer,
        engines: EngineClient,
        encoder: Encoder,
        admission: PdAdmission,
        metrics: RouterMetrics,
    ) -> None:
        self._state = state
        self._renderer = renderer
        self._engines = engines
        self._encoder = encoder
        self._admission = admission
        self._metrics = metrics.for_model(state.cfg.model_name)  # this lane's model's series

    async def prepare(self, ctx: RequestContext) -> None:
        """Everything before the PD: a PD to go to, the rendered prompt, the items' locators."""
        if self._state.cfg.endpoints.text_only:
            _refuse_images(ctx.request)
        if not self._state.pools.eligible_pd():
            self._metrics.rejected("not_ready")
            raise self._state.not_ready_error()
        context = self._state.pools.max_model_len()
        front = self._state.cfg.front_checks
        context_window.check_output(ctx.request, context, front)  # vLLM's chat route: before rendering
        t = time.monotonic()
        try:
            async with ctx.time_limit("preprocessing"):
                with tracing.span("render"):
                    rendered = await render_request(self._renderer, ctx.request, ctx.inline)
        finally:
            ctx.preprocessed()
        self._metrics.preprocess.observe(time.monotonic() - t)
        context_window.check_prompt(
            ctx.request,
            len(rendered.token_ids),
            context,
            front,
            getattr(rendered, "prompt_chars", None),  # the production renderer's; a test's may lack it
            getattr(self._renderer, "max_chars_per_token", None),
        )
        ctx.token_ids = list(rendered.token_ids)
        ctx.items = list(rendered.items)
        if ctx.items:
            t = time.monotonic()
            async with ctx.time_limit("encode"):
                ctx.locators = await self._encoder.encode(ctx)
            self._metrics.encode.observe(time.monotonic() - t)

    async def complete(self, ctx: RequestContext) -> dict[str, Any]:
        """Non-streaming: the whole OpenAI body."""
        try:
            await self.prepare(ctx)
            t = time.monotonic()
            prompt, max_tokens = len(ctx.token_ids), ctx.request.resolved_max_tokens
            # the body is built inside the PD call: an answer it cannot be built from (token
            # ids outside the vocabulary) is charged to that PD and may move to another
            answer = await self._on_a_pd(
                ctx,
                stream=False,
                call=lambda pd, body: self._engines.generate(
                    pd, body, prompt, max_tokens, lambda result: translate.completion(ctx, result, self._renderer, pd)
                ),
                keep_slot=False,
            )
        finally:
            ctx.release_encoders()
        self._metrics.pd.observe(time.monotonic() - t)
        return answer

    async def open_stream(self, ctx: RequestContext) -> PdStream:
        """Streaming: a PD stream whose first event is read; it holds its PD slot until
        `close` (which `relay` calls on every exit path). Whether a PD reads the VEs' blocks
        again after its first event (a preempted request is recomputed) no source we read
        settles, so the request holds its VEs until `close`, not only until that event."""
        try:
            await self.prepare(ctx)
            prompt = len(ctx.token_ids)
            return await self._on_a_pd(
                ctx, stream=True, call=lambda pd, body: self._engines.open_stream(pd, body, prompt), keep_slot=True
            )
        except BaseException:
            ctx.release_encoders()
            raise

    async def _on_a_pd(
        self,
        ctx: RequestContext,
        *,
        stream: bool,
        call: Callable[[Engine, dict], Awaitable[T]],
        keep_slot: bool,
    ) -> T:
        """`call` on an admitted PD; on a retryable failure, once more on a PD not tried yet
        (up to `retries.max_attempts` PDs, within the deadline), with fresh locators if the
        failure may have come from stale ones. `keep_slot`: the result holds the PD slot."""
        tried: set[str] = set()
        last: UpstreamError | None = None
        unreadable = 0  # PDs that could not read this request's blocks
        async with ctx.time_limit("generate"):
            while True:
                if stale := self._encoder.quarantined(ctx):
                    # a PD could not read that VE's blocks since this request was encoded
                    # (another request found out): no PD may be sent to read them
                    await self._encoder.reencode(ctx, stale, {ctx.encoded_by[h] for h in stale})
                engine = await self._admission.acquire(tried, last)
                started = time.monotonic()
                try:
                    result = await call(engine, self._pd_body(ctx, stream))
                except UpstreamError as err:
                    await self._admission.release(engine)
                    last = err
                    # the kit's NIXL connector's failed read: the PD lives, so it may serve the
                    # retry too (a fleet of one PD), after the re-encode
                    lived = self._read_failed_pd_lives(err, ctx)
                    if lived is None:
                        tried.add(engine.id)
                    read_failed = lived or self._failed_read(err, engine, started, ctx)
                    if read_failed is not None:
                        self._encoder.charge_unreadable(ctx, read_failed)
                        unreadable += 1
                    # after a failed read, one more PD at most, and only with blocks of VEs a
                    # PD has read from: each failed read costs a PD its engine core (§3.5)
                    if not self._may_retry(err, tried, ctx) or unreadable > 1:
                        raise
                    self._metrics.retried("generate")
                    log.warning(
                        "generate failed before the client got a byte, retrying on another PD",
                        extra={"request_id": ctx.request_id, "engine": engine.id, "error": err.message},
                    )
                    upstream_read = self._upstream_read_failed(err)
                    elsewhere = upstream_read or lived is not None
                    await self._encoder.refresh_locators(
                        ctx, reencode_all=read_failed is not None or upstream_read, elsewhere=elsewhere
                    )
                    # a read that kills its PD's engine core is tried again only on proven VEs;
                    # one whose PD lives costs nothing more than this retry
                    if read_failed is not None and lived is None and (unproven := self._encoder.unproven(ctx)):
                        log.warning(
                            "not retried: no PD has read the blocks of the VEs that re-encoded the items yet",
                            extra={"request_id": ctx.request_id, "engines": unproven},
                        )
                        raise err from None
                    continue
                except BaseException:
                    await self._admission.release(engine)
                    raise
                self._encoder.reads_succeeded(ctx)
                if not keep_slot:
                    await self._admission.release(engine)
                return result

    def _upstream_read_failed(self, err: UpstreamError) -> bool:
        """Whether a PD's failure may be upstream's failed fetch of an item: in an
        `ec_transfer_params` fleet a generation error, which is how upstream's PD fails a
        request whose item it could not fetch from the address it had (errors.GenerationFailed).
        Its items are then encoded again on other VEs before the retry; no VE is charged: any
        failed generation gives the same answer (docs/router.md "Failure outcomes")."""
        return isinstance(err, GenerationFailed) and self._state.cfg.handoff == EC_TRANSFER_PARAMS

    def _read_failed_pd_lives(self, err: UpstreamError, ctx: RequestContext) -> EcLoadFailed | None:
        """As an `EcLoadFailed`, a PD's generation error on a request with items to read in an
        `ec_locator` fleet whose PDs end a failed read that way (router.yaml `ec_read_failure:
        generation_error`: the kit's NIXL connector on vLLM 0.24/0.29 ends the request
        FINISHED_ERROR and vLLM answers its generic "Internal server error", the cause only in
        the PD's log, engine_plugin scheduler.py). A PD's generation error there has no other
        cause the router can tell apart (the PD has no KV connector), so it is the VE's failure
        (docs/contract.md §11.1): the VE is charged, the items encoded again, the PD retried
        once and never charged. None otherwise."""
        cfg = self._state.cfg
        if not (
            isinstance(err, GenerationFailed)
            and ctx.encoded_by
            and cfg.handoff == EC_LOCATOR
            and cfg.ec_read_failure == EC_READ_GENERATION_ERROR
        ):
            return None
        read = EcLoadFailed(
            err.status, err.message, engine_id=err.engine_id, stage=err.stage, failure=None, retry_other=err.retry_other
        )
        read.client_message = err.client_message
        return read

    @staticmethod
    def _failed_read(
        err: UpstreamError, engine: Engine, started: float, ctx: RequestContext
    ) -> EcLoadFailed | EngineDied | None:
        """`err` if the PD's failure may be a failed read of this request's blocks: its
        ECLoadFailure, or its engine core's death (a real vLLM PD answers only vLLM's
        EngineDeadError message, whatever the cause: upstream.ENGINE_DEAD_MESSAGE) while it
        had blocks of this request to read. A death the router already had an answer about
        before this call went out is not: the engine core was dead when the request came.
        The engine core dies on the first failed read, so every request in flight on it gets
        the same answer and cannot be told from the one whose blocks killed it: each is
        charged to its VEs (docs/router.md "Failure outcomes" says why that is the safe side)."""
        if isinstance(err, EcLoadFailed):
            return err
        if not isinstance(err, EngineDied):
            return None
        known_dead = bool(engine.core_died_at) and started > engine.core_died_at
        if not engine.core_died_at:
            engine.core_died_at = time.monotonic()
        return err if ctx.encoded_by and not known_dead else None

    def _may_retry(self, err: UpstreamError, tried: set[str], ctx: RequestContext) -> bool:
        return err.retry_other and len(tried) < self._state.cfg.retries.max_attempts and time.monotonic() < ctx.deadline

    def _pd_body(self, ctx: RequestContext, stream: bool) -> dict:
        sampling = ctx.request.sampling_params()
        return bodies.pd_request_body(
            ctx.engine_request_id, ctx.token_ids, ctx.items, sampling, ctx.locators, stream, self._state.cfg.handoff
        )

    async def relay(self, ctx: RequestContext, pd: PdStream, outcome: RequestOutcome) -> AsyncIterator[bytes]:
        """The client's SSE bytes, ending in `[DONE]` only when the answer is complete. A
        failure after the start (the PD's connection breaks, its error frame, a stream that
        ends before every choice has its finish_reason, no token for the gap timeout) ends
        the stream with one error frame the router writes itself (the request id, no engine
        address) and nothing after it, and counts against the PD. Malformed PD frames are
        skipped, counted in a metric and logged once per request. The PD stream is closed and
        its slot freed on every exit path (including a client that leaves, which cancels or
        closes this generator). Sets `outcome.status`; the caller records it."""
        translator = translate.StreamTranslator(ctx, self._renderer, pd.engine)
        ok = client_left = False
        t = time.monotonic()
        watch = GapWatch(self._state.cfg.timeouts.stream_gap_s, pd.response.close)
        span = tracing.span("stream")
        try:
            async with ctx.time_limit("generate"):
                payload: bytes | None = pd.first
                while payload is not None:
                    progress = translator.progress
                    frame = translator.translate(payload)
                    if translator.engine_error is not None:
                        raise upstream.stream_error_frame(pd.engine, translator.engine_error)
                    if frame is not None:
                        outcome.first_byte()
                        watch.pause()  # the client taking its frame is not the PD's time
                        yield frame
                        watch.resume()
                    if translator.progress != progress:  # events without tokens do not count
                        watch.last = watch.loop.time()
                    try:
                        payload = await anext(pd.payloads)
                    except StopAsyncIteration:
                        payload = None
            if not translator.complete:
                raise upstream.stream_truncated(pd.engine, bool(getattr(pd.payloads, "done", False)))
            usage = translator.closing_usage()
            if usage is not None:
                yield usage
            ok = True
            pd.engine.served += 1
        except engine_http.EngineCallError as exc:
            cause = upstream.stream_stalled(pd.engine, watch.gap_s) if watch.fired else None
            yield self._stream_failed(ctx, pd, cause or upstream.classify_exception(exc, pd.engine))
        except UpstreamError as err:
            yield self._stream_failed(ctx, pd, err)
        except RouterError as err:
            yield err.sse_frame(ctx.request_id)
        except (asyncio.CancelledError, GeneratorExit):
            client_left = True  # the client disconnected: Starlette cancels or closes the body
            raise
        except Exception:
            log.exception("stream translation failed", extra={"request_id": ctx.request_id})
            yield RouterError(500, "internal error in the router while streaming").sse_frame(ctx.request_id)
        finally:
            watch.stop()
            await self.close(pd, ctx)
            self._metrics.pd.observe(time.monotonic() - t)
            outcome.status = "200" if ok else ("client_closed" if client_left else "stream_error")
            span.end(None if ok else outcome.status)
            if translator.malformed:
                self._metrics.malformed_frames.inc(translator.malformed)
                log.warning(
                    "malformed PD stream frames skipped",
                    extra={"request_id": ctx.request_id, "engine": pd.engine.id, "count": translator.malformed},
                )
            log.info(
                "stream done" if ok else ("client left" if client_left else "stream ended with an error"),
                extra={
                    "request_id": ctx.request_id,
                    "engine_request_id": ctx.engine_request_id,
                    "engine": pd.engine.id,
                    "duration_s": round(time.monotonic() - ctx.t0, 4),
                },
            )
        if ok:
            yield translate.DONE_FRAME

    def _stream_failed(self, ctx: RequestContext, pd: PdStream, err: UpstreamError) -> bytes:
        """Charge a started stream's failure to its PD, log it, and the client's frame."""
        err = self._engines.failed(err, pd.engine)
        log.warning("PD stream failed after start", extra={"request_id": ctx.request_id, "error": err.message})
        return err.for_client().sse_frame(ctx.request_id)

    async def close(self, pd: PdStream, ctx: RequestContext) -> None:
        """Idempotent: close the PD stream, free its slot and the request's VEs (also when the
        response body was never iterated because the client left first)."""
        ctx.release_encoders()
        if pd.closed:
            return
        pd.closed = True
        # release: back to the pool after a complete stream; a stream cut short closes the
        # connection instead, which is how the PD learns to abort
        pd.response.release()
        with anyio.CancelScope(shield=True):
            await self._admission.release(pd.engine)


class GapWatch:
    """Calls `expire` once `gap_s` has been counted since `last`, pauses (`pause` .. `resume`)
    not counted. The relay sets `last` per token and pauses while its client takes a frame: so
    only the wait on the PD counts, and a client that reads slowly or not at all is never
    charged to its PD. routes.py counts the other way round (only a pending write) for the
    client's own bound. One timer per gap rather than one per event: an event only stores a
    time, and the timer, when it fires early, re-arms for the rest of the gap (after a pause,
    `resume` re-arms it)."""

    def __init__(self, gap_s: float, expire: Callable[[], object]) -> None:
        self.loop = asyncio.get_running_loop()
        self.gap_s = gap_s
        self.last = self.loop.time()
        self.fired = False
        self._stopped = False
        self._paused_at: float | None = None
        self._expire = expire
        self._timer: asyncio.TimerHandle | None = self.loop.call_at(self.last + gap_s, self._check)

    def pause(self) -> None:
        self._paused_at = self.loop.time()

    def restart(self) -> None:
        """Count from now (ending a pause)."""
        self.resume()
        self.last = self.loop.time()

    def resume(self) -> None:
        """The pause does not count: `last` moves on by its length."""
        if self._paused_at is None:
            return
        now = self.loop.time()
        self.last += now - self._paused_at
        self._paused_at = None
        if self._timer is None and not (self.fired or self._stopped):  # it fell due during the pause
            self._timer = self.loop.call_at(self.last + self.gap_s, self._check)

    def _check(self) -> None:
        self._timer = None
        if self._paused_at is not None:  # `resume` re-arms
            return
        due = self.last + self.gap_s
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._check)
            return
        self.fired = True
        self._expire()  # the relay's: closing the PD response wakes its read with a EngineCallError

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _refuse_images(request: ChatCompletionRequest) -> None:
    """A text-only fleet has no VE: an image part is the client's mistake (400), refused before
    any rendering or fetch, not a 503 that says to come back later."""
    for i, message in enumerate(request.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if isinstance(part, dict) and part.get("type") == "image_url":
                raise RouterError(
                    400,
                    "this fleet is text-only: it has no encoder (VE) for images; send text only",
                    param=f"messages[{i}].content[{j}]",
                )
