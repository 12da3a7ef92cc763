"""Engine health: which engines get work. Active `/health` probes and the outcome of every
real call feed one set of rules (outlier ejection):

- a refused connection ejects at once: nothing listens;
- `failure_threshold` consecutive failed calls eject, and so does a `failure_ratio` share of
  failures among an engine's last `ratio_window` calls (once half of them are in), which
  catches an engine that fails every other request;
- `failure_threshold` consecutive failed `/health` probes eject;
- connect timeouts alone never eject the last eligible engine of a pool: when the router
  itself is overloaded they hit every engine at once and would empty the pool;
- an engine ejected after a call timed out (it took the work and never answered: hung, while
  its `/health` may well say 200), or because nothing listened (its process died: the one that
  answers next is a restarted, cold engine, whose `/health` says 200 before its first real
  work: a vLLM CPU VE's first encode after a restart outlived the encode deadline under load,
  issue 54's three-host run), comes back only when a *serving probe* succeeds, a tiny real
  encode (VE) or one-token generate (PD) sent by the prober, which also warms it; any other
  ejection ends after `success_threshold` good `/health` probes.

The rules are `EngineHealth` (no I/O); `HealthProber` runs the probes: each engine's on its
own, under its own deadline (`health.timeout_s`, the whole probe), so an engine whose
`/health` is slow delays no other engine's probe, and a new round skips only the engines
whose probe of the last one is still under way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from epd_kit.router.errors import Failure, UpstreamError
from epd_kit.router.pools import Engine, Pools
from epd_kit.router_yaml import Health

log = logging.getLogger("epd_router.health")

ServingProbe = Callable[[Engine], Awaitable[None]]
# one `/health` call within the deadline: the answer's status, or ProbeFailed
HealthCall = Callable[[Engine, Health], Awaitable[int]]


class ProbeFailed(Exception):
    """A `/health` call got no usable answer; `refused`: nothing listens (definitive)."""

    def __init__(self, reason: str, *, refused: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.refused = refused


class EngineHealth:
    """The ejection and readmission rules over live engines (config read at each event)."""

    def __init__(self, health: Callable[[], Health], pools: Callable[[], Pools]) -> None:
        self._health = health
        self._pools = pools

    # --- real calls ----------------------------------------------------------------------

    def call_succeeded(self, engine: Engine) -> None:
        engine.call_failures = 0
        engine.core_died_at = 0.0  # it serves: whatever died before is not this engine core
        engine.streak.clear()
        self._remember(engine, True)

    def call_failed(self, engine: Engine, failure: Failure, reason: str) -> None:
        """A real call failed because of `engine` (connection, timeout, 5xx, bad answer)."""
        engine.failures += 1
        engine.last_error = reason
        engine.call_failures += 1
        engine.streak.add(failure)
        self._remember(engine, False)
        if not engine.healthy:
            return
        if failure is Failure.refused:
            self._eject(engine, reason, gone=True)
            return
        health = self._health()
        outcomes = engine.outcomes
        ratio_tripped = (
            len(outcomes) >= max(2, health.ratio_window // 2)
            and outcomes.count(False) / len(outcomes) >= health.failure_ratio
        )
        if engine.call_failures < health.failure_threshold and not ratio_tripped:
            return
        if engine.streak == {Failure.connect_timeout} and self._last_eligible(engine):
            log.warning(
                "engine kept: connect timeouts alone never eject the last eligible engine of a pool",
                extra={"engine": engine.id, "role": engine.role, "reason": reason},
            )
            return
        self._eject(engine, reason)

    # --- probes --------------------------------------------------------------------------

    def probe_result(self, engine: Engine, ok: bool, reason: str) -> None:
        """One `/health` probe. An engine that needs a serving probe is not readmitted here."""
        health = self._health()
        if not ok:
            engine.probe_successes = 0
            engine.probe_failures += 1
            engine.last_error = reason
            if engine.healthy and engine.probe_failures >= health.failure_threshold:
                self._eject(engine, reason)
            return
        engine.probe_failures = 0
        engine.probe_successes += 1
        if not engine.healthy and not engine.needs_serving_probe and engine.probe_successes >= health.success_threshold:
            self._readmit(engine, reason)

    def probe_definitive(self, engine: Engine, reason: str, *, refused: bool = False) -> None:
        """An immediate probe found the engine gone (refused, or `/health` not 200)."""
        engine.failures += 1
        engine.last_error = reason
        engine.probe_successes = 0
        engine.probe_failures = max(engine.probe_failures, self._health().failure_threshold)
        if engine.healthy:
            self._eject(engine, reason, gone=refused)

    def serving_probe_result(self, engine: Engine, ok: bool, reason: str) -> None:
        if not ok:
            engine.last_error = reason
            return
        engine.needs_serving_probe = False
        if not engine.healthy:
            self._readmit(engine, reason)

    # --- helpers -------------------------------------------------------------------------

    def _remember(self, engine: Engine, ok: bool) -> None:
        engine.outcomes.append(ok)
        del engine.outcomes[: -self._health().ratio_window]

    def _last_eligible(self, engine: Engine) -> bool:
        pool = self._pools().ve if engine.role == "ve" else self._pools().pd
        return not any(e.eligible for e in pool if e is not engine)

    def _eject(self, engine: Engine, reason: str, *, gone: bool = False) -> None:
        # /health may answer while real work hangs, or before a restarted engine can work in time
        if Failure.timeout in engine.streak or gone:
            engine.needs_serving_probe = True
        engine.probe_successes = 0
        engine.set_health(False, reason)

    def _readmit(self, engine: Engine, reason: str) -> None:
        engine.call_failures = 0
        engine.streak.clear()
        engine.outcomes.clear()  # a fresh window: old failures must not eject it again at once
        engine.set_health(True, reason)


class HealthProber:
    """Active `/health` probes of every configured engine, a task per probe started by one
    scheduler task, plus a serving probe (its own task, one at a time per engine) for engines
    that need one."""

    def __init__(
        self,
        call: HealthCall,
        pools: Callable[[], Pools],
        health: Callable[[], Health],
        rules: EngineHealth,
        serving_probe: ServingProbe | None = None,
    ) -> None:
        self._call = call
        self._pools = pools
        self._health = health
        self._rules = rules
        self._serving_probe = serving_probe
        self._task: asyncio.Task | None = None
        self._serving: dict[str, asyncio.Task] = {}
        self._probing: dict[str, asyncio.Task] = {}  # by engine id: a `/health` probe under way
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health-prober")

    def poke(self) -> None:
        """Probe now (after a reload or an ejection) instead of waiting a full interval."""
        self._wake.set()

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._serving.values(), *self._probing.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def probe_all(self) -> None:
        """Probe every engine (but those whose probe is under way) and wait for the probes:
        each ends by its own deadline."""
        await asyncio.gather(*self._start_probes(), return_exceptions=True)

    def _start_probes(self) -> list[asyncio.Task]:
        health = self._health()
        started = []
        for engine in self._pools().all():
            if engine.id not in self._probing:
                task = asyncio.create_task(self._probe(engine, health), name=f"health-probe-{engine.id}")
                self._probing[engine.id] = task
                task.add_done_callback(lambda _, key=engine.id: self._probing.pop(key, None))
                started.append(task)
        return started

    async def _probe(self, engine: Engine, health: Health) -> None:
        try:
            status = await self._call(engine, health)
        except ProbeFailed as exc:
            self._rules.probe_result(engine, False, f"/health: {exc.reason}")
            return
        except Exception:  # a probe bug must not stop probing
            log.exception("health probe failed", extra={"engine": engine.id})
            return
        ok = status == 200
        if ok and engine.needs_serving_probe:
            if self._serving_probe is not None:
                self._start_serving_probe(engine)
                return
            self._rules.serving_probe_result(engine, True, "/health answers (no serving probe available)")
        self._rules.probe_result(engine, ok, f"/health: HTTP {status}")

    def _start_serving_probe(self, engine: Engine) -> None:
        if engine.id not in self._serving:  # one at a time: a hung engine holds it until its deadline
            self._serving[engine.id] = asyncio.create_task(self._serve_probe(engine), name=f"serving-probe-{engine.id}")

    async def _serve_probe(self, engine: Engine) -> None:
        assert self._serving_probe is not None
        try:
            await self._serving_probe(engine)
        except UpstreamError as err:
            self._rules.serving_probe_result(engine, False, f"serving probe: {err.message}")
        except Exception:  # a probe bug must not stop probing
            log.exception("serving probe failed", extra={"engine": engine.id})
        else:
            self._rules.serving_probe_result(engine, True, "serving probe answered")
        finally:
            self._serving.pop(engine.id, None)

    async def _run(self) -> None:
        while True:
            self._start_probes()  # not awaited: the next round is due an interval from now
            self._wake.clear()
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancel that races
                # a poke, and stop() would then wait forever
                async with asyncio.timeout(self._health().interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
