"""One chat request as it moves through the router: its ids, the parsed request, the
rendered prompt and items, the locators of its encoded items, and its deadline.

Two ids: `request_id` is the client's (its `x-request-id`, or a fresh one), which the client
sees in headers, bodies and errors; the engines never see it. They get `engine_request_id`,
always made by the router (a VE call: `<it>/enc/<VE id>`, docs/contract.md §2.2), so concurrent
requests that reuse a client id never collide on an engine (vLLM expects unique ids). The
logs carry both.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import ChatCompletionRequest
from epd_kit.router.pools import Engine
from epd_kit.router.rendering import PreparedItemLike
from epd_kit.router_yaml import RouterConfig
from epd_kit.wire import EcHandoffItem


class Releasable(Protocol):
    def release(self) -> None: ...


@dataclass
class RequestContext:
    request_id: str
    request: ChatCompletionRequest
    model: str
    total_timeout_s: float  # timeouts.total_s when the request arrived
    # 32 hex digits like uuid4().hex, at a sixth of its cost (it is made for every request)
    engine_request_id: str = field(default_factory=lambda: secrets.token_hex(16))
    intake: Releasable | None = None  # the request's place in the preprocessing limit
    # image payloads kept apart from the messages (body.py), until rendering is over
    inline: dict[str, memoryview] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    token_ids: list[int] = field(default_factory=list)
    items: list[PreparedItemLike] = field(default_factory=list)
    locators: dict[str, EcHandoffItem] = field(default_factory=dict)
    encoded_by: dict[str, str] = field(default_factory=dict)  # mm_hash -> VE id
    # VEs whose blocks this request's PD call may read: each keeps one count of `inflight`
    # from its encode until the request ends (`release_encoders`), so a drain waits for it
    encoders_held: dict[str, Engine] = field(default_factory=dict)
    # token ids relayed to a streaming client so far (translate.StreamTranslator): its usage,
    # and what its tenant's token quota is charged (tenants.py)
    completion_tokens: int = 0

    @classmethod
    def start(
        cls,
        request: ChatCompletionRequest,
        request_id: str | None,
        cfg: RouterConfig,
        *,
        intake: Releasable | None = None,
        inline: dict[str, memoryview] | None = None,
    ) -> RequestContext:
        return cls(
            request_id=request_id or secrets.token_hex(16),
            request=request,
            model=request.model or cfg.model_name,
            total_timeout_s=cfg.timeouts.total_s,
            intake=intake,
            inline=inline or {},
        )

    def preprocessed(self) -> None:
        """Rendering is over: leave the preprocessing limit, let the request body go."""
        self.inline = {}
        if self.intake is not None:
            self.intake.release()

    def hold_encoder(self, engine: Engine) -> bool:
        """Keep the `inflight` count `engine`'s encode took until the request ends; False if
        this request already holds one of `engine` (the caller then gives its count back)."""
        if engine.id in self.encoders_held:
            return False
        self.encoders_held[engine.id] = engine
        return True

    def release_encoders(self) -> None:
        """The request is over: no PD reads its VEs' blocks any more (idempotent)."""
        for engine in self.encoders_held.values():
            engine.inflight -= 1
        self.encoders_held.clear()

    @property
    def completion_id(self) -> str:
        return f"chatcmpl-{self.request_id}"

    @property
    def deadline(self) -> float:
        """`time.monotonic()` value by which the whole request must be done."""
        return self.t0 + self.total_timeout_s

    def time_limit(self, stage: str) -> StageLimit:
        """Run a stage under the request's deadline; running out is a 504 naming the stage."""
        return StageLimit(self, stage)

    def stage_timed_out(self, stage: str) -> RouterError:
        return RouterError(
            504, f"request exceeded the router's total timeout of {self.total_timeout_s:g}s during {stage}"
        )


class StageLimit:
    """`RequestContext.time_limit`: an `asyncio.Timeout` at the request's deadline whose
    expiry becomes a 504 naming the stage. A class, not a generator context manager: two of
    them per request. A TimeoutError that is not this limit's own (an engine call's,
    the engine client's) passes unchanged."""

    __slots__ = ("_ctx", "_limit", "_stage")

    def __init__(self, ctx: RequestContext, stage: str) -> None:
        self._ctx = ctx
        self._stage = stage
        loop = asyncio.get_running_loop()
        self._limit = asyncio.timeout_at(loop.time() + (ctx.deadline - time.monotonic()))

    async def __aenter__(self) -> None:
        await self._limit.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._limit.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if not self._limit.expired():
                raise
            raise self._ctx.stage_timed_out(self._stage) from None
        if exc_type is not None and issubclass(exc_type, TimeoutError) and self._limit.expired():
            raise self._ctx.stage_timed_out(self._stage) from None
