"""PD admission: which PD a request generates on, and the bounded first-come-first-served
wait when all are full.

A request takes a slot on the healthy active PD with the fewest outstanding requests below
`placement.pd_max_inflight` (ties round-robin, placement.py). When every PD is at its cap, or
others are already waiting, it joins a FIFO queue (`queue_size`) and waits at most
`queue_timeout_s`, then gets a 429 with Retry-After. A freed slot goes to the longest waiter
that may use it (a retry excludes the PDs it already tried), never to a newcomer. No
eligible PD at all is a 503: waiting would not help.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from epd_kit.router.errors import RouterError
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.placement import RoundRobin
from epd_kit.router.pools import Engine
from epd_kit.router.state import RouterState

# Waiters also look again this often on their own: a health change frees slots without a
# release (a PD readmitted, a reload).
RECHECK_S = 0.25


@dataclass(eq=False)
class Waiter:
    exclude: frozenset[str]
    slot: asyncio.Future[Engine] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class WaitQueue:
    """Requests waiting for a PD slot, in arrival order."""

    def __init__(self) -> None:
        self._waiters: deque[Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def join(self, exclude: frozenset[str]) -> Waiter:
        waiter = Waiter(exclude)
        self._waiters.append(waiter)
        return waiter

    def leave(self, waiter: Waiter) -> None:
        with contextlib.suppress(ValueError):  # served already
            self._waiters.remove(waiter)

    def serve(self, pick: Callable[[frozenset[str]], Engine | None]) -> None:
        """Offer slots in arrival order: `pick(exclude)` returns a taken engine or None. A
        waiter that cannot use what is free (it excluded that PD) keeps its place."""
        for waiter in list(self._waiters):
            if waiter.slot.done():
                continue
            engine = pick(waiter.exclude)
            if engine is not None:
                self._waiters.remove(waiter)
                waiter.slot.set_result(engine)


class PdAdmission:
    def __init__(self, state: RouterState, metrics: RouterMetrics) -> None:
        self._state = state
        self._metrics = metrics.for_model(state.cfg.model_name)  # this lane's model's series
        self._rr = RoundRobin()
        self.queue = WaitQueue()

    async def acquire(self, exclude: set[str], last_error: RouterError | None) -> Engine:
        """A slot on a PD not in `exclude`. When none is left to try, `last_error` (the
        previous attempt's failure) is raised if given, else a 503."""
        placement = self._state.cfg.placement
        self._check_eligible(exclude, last_error)
        if not self.queue.waiting:  # nobody is ahead
            engine = self._take(frozenset(exclude))
            if engine is not None:
                return engine
        if self.queue.waiting >= placement.queue_size:
            self._metrics.rejected("queue_full")
            raise RouterError(
                429,
                f"overloaded: every PD engine is at its limit of {placement.pd_max_inflight} requests "
                f"and the wait queue is full ({placement.queue_size})",
                retry_after=1,
            )
        waiter = self.queue.join(frozenset(exclude))
        loop = asyncio.get_running_loop()
        give_up = loop.time() + placement.queue_timeout_s
        try:
            while True:
                self.queue.serve(self._take)
                if waiter.slot.done():
                    return waiter.slot.result()
                self._check_eligible(exclude, last_error)
                remaining = give_up - loop.time()
                if remaining <= 0:
                    self._metrics.rejected("queue_timeout")
                    raise RouterError(
                        429, f"overloaded: waited {placement.queue_timeout_s:g}s for a free PD slot", retry_after=1
                    )
                await asyncio.wait({waiter.slot}, timeout=min(remaining, RECHECK_S))
        except BaseException:
            self.queue.leave(waiter)
            if waiter.slot.done() and not waiter.slot.cancelled():
                await self.release(waiter.slot.result())  # served as it gave up: pass the slot on
            raise

    async def release(self, engine: Engine) -> None:
        engine.inflight -= 1
        self.queue.serve(self._take)

    async def pools_changed(self) -> None:
        """A reload may have added PDs or returned them to `active`: offer the new slots."""
        self.queue.serve(self._take)

    def _take(self, exclude: frozenset[str]) -> Engine | None:
        """Take a slot on the PD that placement picks, or None when all eligible ones are full."""
        pools = self._state.pools
        eligible = {e.id: e for e in pools.eligible_pd() if e.id not in exclude}
        # all configured ids in config order keep the round-robin cursor stable while engines
        # come and go; ineligible ones are excluded
        pick = self._rr.choose_pd(
            [e.id for e in pools.pd],
            {e.id: e.inflight for e in pools.pd},
            self._state.cfg.placement.pd_max_inflight,
            exclude={e.id for e in pools.pd if e.id not in eligible},
        )
        if pick is None:
            return None
        engine = eligible[pick]
        engine.inflight += 1
        return engine

    def _check_eligible(self, exclude: set[str], last_error: RouterError | None) -> None:
        if any(e.id not in exclude for e in self._state.pools.eligible_pd()):
            return
        if last_error is not None:
            raise last_error
        self._metrics.rejected("not_ready")
        raise self._state.not_ready_error()
