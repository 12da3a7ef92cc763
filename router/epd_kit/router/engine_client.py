"""The router's HTTP to the engines: one pooled client, one call per engine request under a
deadline derived from its work (deadlines.py), the probers, and the health signal of every
call (the rules are health.py).

Each call either returns the parsed answer or raises an `UpstreamError` (classified in
upstream.py) after charging the failure to the engine when it is the engine's fault.

The engine calls go through the router's own small client (engine_http.py: asyncio.Protocol
and httptools, a keep-alive pool per engine origin; docs/notes/2026-12-01-peers-at-info-issue-23.md
"Item 7, second round" has what it cost against the clients before it). An engine POST's deadline is the client's own
timer (`DeadlineExceeded`), not an `asyncio.timeout` around the call. Kept-alive
connections survive idle pauses (`ENGINE_KEEPALIVE_S`); one the engine closed while idle
(vLLM's uvicorn after 5 s) is dropped when the pool next looks at it, and a request that
races such a close (the connection ends before any answer byte, by a FIN or a reset) is resent once on a fresh
connection (`_send`). The `/health` probes go through the same client (`health_status`),
each under its own deadline.

No answer is trusted to be small: a non-streaming answer is read up to `MAX_ANSWER_BYTES`,
a `/health` answer up to `MAX_HEALTH_BYTES`, an error answer to a stream request up to
`MAX_ERROR_BYTES` (engine_http.py caps every head); more is an `AnswerTooLarge`, a 502
charged to the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from epd_kit.router import bodies, deadlines, engine_http, tracing, upstream
from epd_kit.router.bodies import VeBody, ve_body
from epd_kit.router.engine_keys import EngineKeys
from epd_kit.router.errors import UpstreamError
from epd_kit.router.health import EngineHealth, HealthProber, ProbeFailed
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.pd_stream import SseReader
from epd_kit.router.pools import Engine
from epd_kit.router.probes import ServingProbes
from epd_kit.router.rendering import PreparedItemLike
from epd_kit.router.state import RouterState
from epd_kit.router_yaml import Health
from epd_kit.wire import GENERATE_PATH, EcHandoffItem, GenerateResponse

# the client's own read timeout stays a little behind the call's deadline, so the deadline
# (whose message says what it was derived from) is what fires
_READ_SLACK_S = 1.0

# How long an idle pooled engine connection is kept: well above the pauses between bursts a
# router sees (a burst after 30 s idle must not redial every engine connection). Engines
# may close sooner; the pool then drops those connections (see the module docstring).
ENGINE_KEEPALIVE_S = 120.0

# The most of an answer read whole. A generate answer is its token ids (and logprobs, if
# asked: ~1 KiB per token with 20 of them), an encode answer its locators: 16 MiB is above
# any of them the router asks for (longer generations stream). vLLM's /health answers an
# empty body; an error body is a short JSON (only its first 4 KiB is ever read: upstream.py).
MAX_ANSWER_BYTES = 16 * 1024 * 1024
MAX_HEALTH_BYTES = 64 * 1024
MAX_ERROR_BYTES = 64 * 1024

T = TypeVar("T")

log = logging.getLogger("epd_router.engines")


@dataclass
class PdStream:
    """An open PD stream whose first payload has already been read (so it is committed)."""

    engine: Engine
    response: engine_http.Response
    payloads: AsyncIterator[bytes]
    first: bytes
    closed: bool = False


class EngineClient:
    def __init__(self, state: RouterState, metrics: RouterMetrics) -> None:
        self._state = state
        self._metrics = metrics
        self.health = EngineHealth(lambda: state.cfg.health, lambda: state.pools)
        self._http: engine_http.EngineHTTP | None = None
        self._prober: HealthProber | None = None
        self._probes: ServingProbes | None = None
        self._keys = EngineKeys()

    def set_keys(self, keys: tuple[bytes, ...]) -> None:
        """The engine keys (engine_keys.py) from now on: at start and on a reload."""
        self._keys = EngineKeys(keys)
        if self._http is not None:
            self._http.keys = self._keys

    async def start(self, probes: ServingProbes | None = None) -> None:
        """`probes`: the serving probes that readmit an engine ejected as hung (without them,
        `/health` alone readmits it)."""
        self._probes = probes
        # no cap on connections of our own (engines' slots are admission.py's business)
        self._http = engine_http.EngineHTTP(keepalive_s=ENGINE_KEEPALIVE_S, keys=self._keys)
        self._prober = HealthProber(
            self.health_status,
            lambda: self._state.pools,
            lambda: self._state.cfg.health,
            self.health,
            self.serving_probe if probes is not None else None,
        )
        await self._prober.probe_all()  # know who is up before the first request
        self._prober.start()

    async def aclose(self) -> None:
        if self._prober:
            await self._prober.stop()
        if self._http:
            self._http.close()

    @property
    def http(self) -> engine_http.EngineHTTP:
        assert self._http is not None, "EngineClient.start() was not awaited"
        return self._http

    def probe_soon(self) -> None:
        """Run a probe round now (after a reload or an ejection), not a full interval later."""
        if self._prober:
            self._prober.poke()

    # --- calls -----------------------------------------------------------------------------

    async def encode(
        self, engine: Engine, items: Sequence[PreparedItemLike], request_id: str
    ) -> dict[str, EcHandoffItem]:
        """One encode POST to a VE: a locator for every item, or an UpstreamError. The caller
        has reserved the items' tokens in `engine.inflight_work`."""
        try:
            with tracing.engine_call(engine, "ve encode"):
                locators = await self._encode(engine, items, request_id)
        except UpstreamError as err:
            raise self.failed(err, engine) from None
        self.health.call_succeeded(engine)
        engine.served += 1
        return locators

    async def generate(
        self,
        engine: Engine,
        body: dict,
        prompt_tokens: int,
        max_tokens: int | None,
        accept: Callable[[GenerateResponse], T],
    ) -> T:
        """One non-streaming generate POST to a PD; its answer through `accept` (what the
        router makes of it: translate.completion), which may find it invalid (an
        UpstreamError: token ids outside the vocabulary), charged to the PD as any other
        invalid answer before the call counts as a success."""
        try:
            with tracing.engine_call(engine, "pd generate"):
                result = accept(await self._generate(engine, body, prompt_tokens, max_tokens))
        except UpstreamError as err:
            raise self.failed(err, engine) from None
        self.health.call_succeeded(engine)
        engine.served += 1
        return result

    async def open_stream(self, engine: Engine, body: dict, prompt_tokens: int) -> PdStream:
        """Open a streaming generate on a PD and read its first payload: until then a failure
        is an error here (the request may still move to another PD); after it, the stream is
        committed. The caller closes the returned stream's response."""
        engine.inflight_work += prompt_tokens  # waiting for prefill until the first payload
        try:
            with tracing.engine_call(engine, "pd generate"):
                pd = await self._open_stream(engine, body)
        except UpstreamError as err:
            raise self.failed(err, engine) from None
        finally:
            engine.inflight_work -= prompt_tokens
        self.health.call_succeeded(engine)
        return pd

    async def serving_probe(self, engine: Engine) -> None:
        """The prober's tiny real request (probes.py); raises UpstreamError. Not a client
        request: its outcome goes to the health rules through the prober only."""
        assert self._probes is not None
        if engine.role == "pd":
            body = self._probes.pd_body(self._state.cfg.handoff)
            await self._generate(engine, body, len(body["token_ids"]), 1)
        elif (item := await self._probes.image_item()) is not None:
            engine.inflight_work += item.length
            try:
                await self._encode(engine, [item], ServingProbes.request_id())
            finally:
                engine.inflight_work -= item.length

    async def check(self, engine: Engine) -> None:
        """One immediate /health probe; an engine that refuses connections is ejected now."""
        try:
            status = await self.health_status(engine, self._state.cfg.health)
        except ProbeFailed as exc:
            if exc.refused:
                self.health.probe_definitive(engine, f"/health: {exc.reason}", refused=True)
            else:
                self.health.probe_result(engine, False, f"/health: {exc.reason}")
            return
        if status != 200:
            self.health.probe_definitive(engine, f"/health: HTTP {status}")

    async def health_status(self, engine: Engine, health: Health) -> int:
        """`GET /health`: its status, all of it within `health.timeout_s` (dial, head and a
        body of at most MAX_HEALTH_BYTES), or ProbeFailed."""
        http = self.http
        deadline = http.loop.time() + health.timeout_s
        limits = {"connect_s": health.timeout_s, "read_s": health.timeout_s, "deadline": deadline}
        try:
            try:
                resp, _ = await http.get(engine.url, "/health", max_body=MAX_HEALTH_BYTES, **limits)
            except engine_http.ClosedBeforeAnswer:  # an idle connection the engine had closed
                resp, _ = await http.get(engine.url, "/health", max_body=MAX_HEALTH_BYTES, fresh=True, **limits)
        except engine_http.CannotConnect as exc:
            raise ProbeFailed(type(exc).__name__, refused=True) from None
        except engine_http.EngineCallError as exc:  # before TimeoutError: the client's timeouts are both
            raise ProbeFailed(type(exc).__name__) from None
        except TimeoutError:  # engine_http.DeadlineExceeded
            raise ProbeFailed(f"no answer within {health.timeout_s:g}s (health.timeout_s)") from None
        if resp.status == 200 and engine.role == "pd" and (engine.max_model_len is None or not engine.healthy):
            # before the probe admits it, and again on each return (a restart may change it)
            await self._learn_context_length(engine, limits)
        return resp.status

    async def _learn_context_length(self, engine: Engine, limits: dict[str, float]) -> None:
        """A PD's `max_model_len` from its `GET /v1/models` (vLLM's ModelCard carries it:
        vllm/entrypoints/openai/models/serving.py `show_available_models`, v0.24.0 and v0.29.0;
        the sim's too), for the OpenAI front's context check (generation.py). Any failure leaves
        it unknown until the next probe: the check is skipped, never the engine."""
        try:
            resp, body = await self.http.get(engine.url, "/v1/models", max_body=MAX_HEALTH_BYTES, **limits)
            cards = json.loads(body)["data"] if resp.status == 200 else []
            lengths = [c["max_model_len"] for c in cards if isinstance(c, dict)]
        except (engine_http.EngineCallError, TimeoutError, ValueError, KeyError, TypeError):
            return
        if lengths and all(type(n) is int and n > 0 for n in lengths):
            engine.max_model_len = min(lengths)

    def failed(self, err: UpstreamError, engine: Engine) -> UpstreamError:
        """Charge `err` to `engine` when it is the engine's fault (passive health); returns it."""
        if err.failure is not None:
            self.health.call_failed(engine, err.failure, err.message)
            self._metrics.engine_failures.labels(engine.id, engine.role).inc()
            self.probe_soon()
        return err

    # --- the calls themselves: no health bookkeeping ----------------------------------------

    async def _encode(
        self, engine: Engine, items: Sequence[PreparedItemLike], request_id: str
    ) -> dict[str, EcHandoffItem]:
        deadline = deadlines.encode_s(self._state.cfg.timeouts, engine.inflight_work)
        what = f"{len(items)} item(s), {engine.inflight_work} embedding tokens in flight on it"
        body = ve_body(request_id, engine.id, items)
        answer = await self._post(engine, body, deadline, what)
        if answer.status != 200:
            raise upstream.classify_status(answer, engine)
        return upstream.parse_ve_response(answer, engine, [i.mm_hash for i in items], self._state.cfg.handoff)

    async def _generate(
        self, engine: Engine, body: dict, prompt_tokens: int, max_tokens: int | None
    ) -> GenerateResponse:
        engine.inflight_work += prompt_tokens
        try:
            deadline = deadlines.answer_s(self._state.cfg.timeouts, engine.inflight_work, max_tokens)
            what = f"{prompt_tokens} prompt tokens, max_tokens {max_tokens}, {engine.inflight_work} waiting on it"
            answer = await self._post(engine, bodies.encode_body(body), deadline, what)
        finally:
            engine.inflight_work -= prompt_tokens
        if answer.status != 200:
            raise upstream.classify_status(answer, engine)
        return upstream.parse_pd_response(answer, engine)

    async def _post(self, engine: Engine, content: bytes | VeBody, deadline: float, what: str) -> upstream.EngineAnswer:
        """One POST read in full within `deadline` (the client's own deadline: what an
        `asyncio.timeout(deadline)` around the call did, one timer cheaper)."""
        try:
            resp, body = await self._send(engine, content, deadline + _READ_SLACK_S, self.http.loop.time() + deadline)
            return upstream.EngineAnswer(resp.status, body, resp.headers)
        except engine_http.EngineCallError as exc:  # before TimeoutError: the client's timeouts are both
            raise upstream.classify_exception(exc, engine) from None
        except TimeoutError:  # engine_http.DeadlineExceeded
            raise upstream.deadline_exceeded(engine, deadline, what) from None

    async def _send(
        self, engine: Engine, content: bytes | VeBody, read_s: float, deadline_at: float
    ) -> tuple[engine_http.Response, bytes]:
        """POST `content` to the engine's generate route; the answer read whole, all by the
        loop time `deadline_at`. A connection the engine closed just as the request went
        out (its keep-alive expiry racing our reuse) ends before any answer byte: that POST
        is resent once, on a fresh connection. A dead engine then refuses the second dial,
        which is what health.py should see; an engine that drops requests it has read fails
        the resend too."""
        connect_s = self._state.cfg.timeouts.connect_s
        http = self.http
        limits = {"connect_s": connect_s, "read_s": read_s, "deadline": deadline_at, "max_body": MAX_ANSWER_BYTES}
        for attempt in (0, 1):  # a second time only with the other engine key (`_other_key`)
            index = http.keys.index(engine.url)
            try:
                resp, body = await http.post(engine.url, GENERATE_PATH, content, **limits)
            except engine_http.ConnectionFailed as exc:
                if not _raced_a_close(exc):
                    raise
                resp, body = await http.post(engine.url, GENERATE_PATH, content, fresh=True, **limits)
            if attempt or not self._other_key(engine, resp.status, index):
                break
        return resp, body

    def _other_key(self, engine: Engine, status: int, index: int) -> bool:
        """A 401: the engine refused the key sent (`index`). During a rotation it may hold the
        other one (engine_keys.py): True when the request is to go again with it."""
        if status != 401 or not self.http.keys.refused(engine.url, index):
            return False
        keys = self.http.keys
        log.warning(
            "engine refused the engine key; trying the other key of engine_auth.key_file",
            extra={"engine": engine.id, "refused_key": index + 1, "now_key": keys.index(engine.url) + 1},
        )
        return True

    async def _open(self, engine: Engine, content: bytes, read_s: float) -> engine_http.Response:
        """As `_send`, for a stream: the answer with its head read (the same resend rule)."""
        connect_s = self._state.cfg.timeouts.connect_s
        for attempt in (0, 1):  # a second time only with the other engine key, as `_send`
            index = self.http.keys.index(engine.url)
            try:
                resp = await self.http.open(engine.url, GENERATE_PATH, content, connect_s=connect_s, read_s=read_s)
            except engine_http.ConnectionFailed as exc:
                if not _raced_a_close(exc):
                    raise
                resp = await self.http.open(
                    engine.url, GENERATE_PATH, content, connect_s=connect_s, read_s=read_s, fresh=True
                )
            if attempt or not self._other_key(engine, resp.status, index):
                break
            resp.close()
        return resp

    async def _open_stream(self, engine: Engine, body: dict) -> PdStream:
        timeouts = self._state.cfg.timeouts
        deadline = deadlines.first_token_s(timeouts, engine.inflight_work)
        resp: engine_http.Response | None = None
        committed = False
        try:
            async with asyncio.timeout(deadline):
                # after the first payload, generation.GapWatch bounds the gaps between events
                # (timeouts.stream_gap_s); this read timeout is only a backstop
                resp = await self._open(engine, bodies.encode_body(body), timeouts.pd_s)
                if resp.status != 200:
                    raise upstream.classify_status(
                        upstream.EngineAnswer(resp.status, await resp.read(MAX_ERROR_BYTES), resp.headers), engine
                    )
                payloads = SseReader(resp.iter_any(), engine)  # bounded lines, LF or CRLF
                try:
                    first = await anext(payloads)
                except StopAsyncIteration:
                    raise upstream.bad_body(engine, "stream ended before any token") from None
            err = upstream.classify_stream_error(first, engine)
            if err is not None:
                raise err
            committed = True
            return PdStream(engine=engine, response=resp, payloads=payloads, first=first)
        except engine_http.EngineCallError as exc:  # before TimeoutError: the client's timeouts are both
            raise upstream.classify_exception(exc, engine) from None
        except TimeoutError:
            what = f"first token, {engine.inflight_work} prompt tokens waiting on it"
            raise upstream.deadline_exceeded(engine, deadline, what) from None
        finally:
            if resp is not None and not committed:
                resp.close()


def _raced_a_close(exc: engine_http.ConnectionFailed) -> bool:
    """A call that failed as an engine's keep-alive close raced our reuse of the connection:
    it ended before any answer byte, by a FIN (`ClosedBeforeAnswer`) or a reset
    (`ConnectionBroken`: an engine that closes with our request unread in its buffer resets
    it). A refused dial is not a race."""
    return isinstance(exc, (engine_http.ClosedBeforeAnswer, engine_http.ConnectionBroken)) and not isinstance(
        exc, engine_http.CannotConnect
    )
