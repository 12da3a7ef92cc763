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
    """`RequestContext.time_limit`: the request's deadline over one stage, whose expiry is a
    504 naming the stage. What an `asyncio.timeout_at` at the deadline did (it cancels the
    stage's task when the deadline passes; `uncancel` tells its own cancel from another's, as
    asyncio.Timeout does in Python 3.11, asyncio/timeouts.py), with one timer handle and one
    look-up of the loop instead of a Timeout, its state machine and three look-ups of the
    running loop (each a getpid() system call in Python 3.11): two of them per request,
    docs/benchmarks.md "Issue 58 item 6". A class, not a generator context manager. A
    TimeoutError that is not this limit's own (an engine call's, the engine client's) passes
    unchanged."""

    __slots__ = ("_ctx", "_expired", "_handle", "_stage", "_task")

    def __init__(self, ctx: RequestContext, stage: str) -> None:
        self._ctx = ctx
        self._stage = stage
        self._expired = False
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a stage's time limit must be used inside a task")
        self._task = task
        # a deadline already past fires on the loop's next turn, as asyncio.Timeout's does
        self._handle = loop.call_at(loop.time() + (self._ctx.deadline - time.monotonic()), self._on_timeout)

    def _on_timeout(self) -> None:
        self._handle = None
        self._expired = True
        assert self._task is not None
        self._task.cancel()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if not self._expired:
            return
        assert self._task is not None
        if self._task.uncancel() == 0 and exc_type is asyncio.CancelledError:
            raise self._ctx.stage_timed_out(self._stage) from None
        if exc_type is not None and issubclass(exc_type, TimeoutError):
            raise self._ctx.stage_timed_out(self._stage) from None
