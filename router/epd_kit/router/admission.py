"""PD admission: which PD a request generates on, and the bounded wait when all are full.

A request takes a slot on the healthy active PD with the fewest outstanding requests below
`placement.pd_max_inflight` (ties round-robin, placement.py). When every PD is at its cap it
waits in a bounded queue (`queue_size`) for at most `queue_timeout_s`, then gets a 429 with
Retry-After. No eligible PD at all is a 503: waiting would not help.
"""

from __future__ import annotations

import asyncio

from epd_kit.router.errors import RouterError
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.placement import RoundRobin
from epd_kit.router.pools import Engine
from epd_kit.router.state import RouterState

# Waiters also re-check this often on their own: health changes free slots without a notify.
RECHECK_S = 0.25


class WaitQueue:
    """Requests waiting for a PD slot. Every change wakes all waiters and each re-checks, so
    the order among waiters is not arrival order: whoever looks first after a release wins."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self.waiting = 0

    def try_enter(self, capacity: int) -> bool:
        """Take a place in the queue unless `capacity` waiters are already there."""
        if self.waiting >= capacity:
            return False
        self.waiting += 1
        return True

    def leave(self) -> None:
        self.waiting -= 1

    async def wait(self, timeout: float) -> None:
        """Until a slot may have freed up (`wake_all`) or `timeout` seconds, whichever is first."""
        async with self._changed:
            try:
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def wake_all(self) -> None:
        async with self._changed:
            self._changed.notify_all()


class PdAdmission:
    def __init__(self, state: RouterState, metrics: RouterMetrics) -> None:
        self._state = state
        self._metrics = metrics
        self._rr = RoundRobin()
        self.queue = WaitQueue()

    async def acquire(self, exclude: set[str], last_error: RouterError | None) -> Engine:
        """A slot on a PD not in `exclude`. When none is left to try, `last_error` (the
        previous attempt's failure) is raised if given, else a 503."""
        placement = self._state.cfg.placement
        loop = asyncio.get_running_loop()
        wait_until = loop.time() + placement.queue_timeout_s
        queued = False
        try:
            while True:
                pools = self._state.pools
                eligible = {e.id: e for e in pools.eligible_pd() if e.id not in exclude}
                if not eligible:
                    if last_error is not None:
                        raise last_error
                    self._metrics.rejections.labels("not_ready").inc()
                    raise self._state.not_ready_error()
                # all configured ids in config order keep the round-robin cursor stable
                # while engines come and go; ineligible ones are excluded
                pick = self._rr.choose_pd(
                    [e.id for e in pools.pd],
                    {e.id: e.inflight for e in pools.pd},
                    placement.pd_max_inflight,
                    exclude={e.id for e in pools.pd if e.id not in eligible},
                )
                if pick is not None:
                    engine = eligible[pick]
                    engine.inflight += 1
                    return engine
                if not queued:
                    if not self.queue.try_enter(placement.queue_size):
                        self._metrics.rejections.labels("queue_full").inc()
                        raise RouterError(
                            429,
                            f"overloaded: all {len(eligible)} PD engines are at their limit of "
                            f"{placement.pd_max_inflight} requests and the wait queue is full "
                            f"({placement.queue_size})",
                            retry_after=1,
                        )
                    queued = True
                remaining = wait_until - loop.time()
                if remaining <= 0:
                    self._metrics.rejections.labels("queue_timeout").inc()
                    raise RouterError(
                        429,
                        f"overloaded: waited {placement.queue_timeout_s:g}s for a free PD slot",
                        retry_after=1,
                    )
                await self.queue.wait(min(remaining, RECHECK_S))
        finally:
            if queued:
                self.queue.leave()

    async def release(self, engine: Engine) -> None:
        engine.inflight -= 1
        await self.queue.wake_all()

    async def pools_changed(self) -> None:
        """A reload may have added PDs or returned them to `active`: let waiters look again."""
        await self.queue.wake_all()
