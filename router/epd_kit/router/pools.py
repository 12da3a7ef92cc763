"""Engine pools: live state per engine (health, in-flight, counters) and atomic reloads.

An `Engine` object lives as long as its id is configured with the same URL. A reload builds
a new `Pools` snapshot (reusing surviving `Engine` objects) and swaps one reference; requests
hold the `Engine` objects they picked, so an engine removed by a reload still finishes the
work it has and its counters stay correct.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import httpx

from epd_kit.router.config import Endpoint, EngineState, Health, RouterConfig

log = logging.getLogger("epd_router.pools")

Role = Literal["ve", "pd"]


@dataclass(eq=False)
class Engine:
    id: str
    url: str
    role: Role
    state: EngineState = EngineState.active
    healthy: bool = False  # unknown until the first probe answers
    inflight: int = 0  # requests currently on this engine
    inflight_work: int = 0  # VE: embedding tokens in flight (the load-bound measure)
    served: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_error: str | None = None
    last_change: float = field(default_factory=time.monotonic)
    removed: bool = False

    @property
    def eligible(self) -> bool:
        return self.healthy and self.state is EngineState.active and not self.removed

    def set_health(self, healthy: bool, reason: str) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            self.last_change = time.monotonic()
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "engine %s",
                "healthy" if healthy else "ejected",
                extra={"engine": self.id, "role": self.role, "reason": reason},
            )

    def record_probe(self, ok: bool, reason: str, health: Health) -> None:
        if ok:
            self.consecutive_failures = 0
            self.consecutive_successes += 1
            if not self.healthy and self.consecutive_successes >= health.success_threshold:
                self.set_health(True, reason)
        else:
            self.consecutive_successes = 0
            self.consecutive_failures += 1
            self.last_error = reason
            if self.healthy and self.consecutive_failures >= health.failure_threshold:
                self.set_health(False, reason)

    def record_passive_failure(self, reason: str, *, eject_now: bool, health: Health) -> None:
        """A real request failed because of this engine (connect error, timeout, 5xx)."""
        self.failures += 1
        self.last_error = reason
        self.consecutive_successes = 0
        if eject_now:
            self.consecutive_failures = max(self.consecutive_failures, health.failure_threshold)
            self.set_health(False, reason)
        else:
            self.record_probe(False, reason, health)

    def snapshot(self) -> dict:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.role,
            "state": "removed" if self.removed else self.state.value,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "inflight_work": self.inflight_work,
            "served": self.served,
            "failures": self.failures,
            "last_error": self.last_error,
        }


@dataclass(frozen=True)
class Pools:
    """One immutable snapshot of both pools (config order kept)."""

    ve: tuple[Engine, ...]
    pd: tuple[Engine, ...]

    def all(self) -> tuple[Engine, ...]:
        return self.ve + self.pd

    def eligible_ve(self) -> list[Engine]:
        return [e for e in self.ve if e.eligible]

    def eligible_pd(self) -> list[Engine]:
        return [e for e in self.pd if e.eligible]

    def by_id(self) -> dict[str, Engine]:
        return {e.id: e for e in self.all()}


def build_pools(cfg: RouterConfig, previous: Pools | None = None) -> tuple[Pools, list[Engine]]:
    """New snapshot for `cfg`; returns it and the engines that are no longer configured."""
    old = previous.by_id() if previous else {}

    def make(ep: Endpoint, role: Role) -> Engine:
        prev = old.get(ep.id)
        if prev is not None and prev.url == ep.url and prev.role == role:
            prev.state = ep.state
            return prev
        return Engine(id=ep.id, url=ep.url, role=role, state=ep.state)

    pools = Pools(
        ve=tuple(make(ep, "ve") for ep in cfg.endpoints.ve),
        pd=tuple(make(ep, "pd") for ep in cfg.endpoints.pd),
    )
    kept = {id(e) for e in pools.all()}
    removed = [e for e in old.values() if id(e) not in kept]
    for engine in removed:
        engine.removed = True
    return pools, removed


class HealthProber:
    """Active `/health` probes of every configured engine, one task for all of them."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        pools: Callable[[], Pools],
        health: Callable[[], Health],
    ) -> None:
        self._client = client
        self._pools = pools
        self._health = health
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health-prober")

    def poke(self) -> None:
        """Probe now (after a reload or an ejection) instead of waiting a full interval."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def probe_all(self) -> None:
        health = self._health()
        engines = self._pools().all()
        await asyncio.gather(*(self._probe(e, health) for e in engines))

    async def _probe(self, engine: Engine, health: Health) -> None:
        try:
            resp = await self._client.get(f"{engine.url}/health", timeout=health.timeout_s)
        except httpx.HTTPError as exc:
            engine.record_probe(False, f"/health: {type(exc).__name__}", health)
            return
        ok = resp.status_code == 200
        engine.record_probe(ok, f"/health: HTTP {resp.status_code}", health)

    async def _run(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # a prober bug must not stop probing
                log.exception("health probe round failed")
            self._wake.clear()
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancel that races
                # a poke, and stop() would then wait forever
                async with asyncio.timeout(self._health().interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
