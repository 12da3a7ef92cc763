"""Engine pools: live state per engine (health, in-flight, counters) and atomic reloads
(the health rules and probes are health.py).

An `Engine` object lives as long as its id is configured with the same URL. A reload builds
a new `Pools` snapshot (reusing surviving `Engine` objects) and swaps one reference; requests
hold the `Engine` objects they picked, so an engine removed by a reload still finishes the
work it has and its counters stay correct.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from epd_kit.plan.command import Role
from epd_kit.router.errors import Failure
from epd_kit.router_yaml import Endpoint, EngineState, RouterConfig

log = logging.getLogger("epd_router.pools")


# How long a VE whose blocks a PD could not read stays out: the first time, then doubled per
# repeat up to the cap. Its /health and an encode can both succeed while its side channel
# refuses reads, and only a PD's read (which kills that PD's engine core) tells, so a VE
# whose side channel stays broken costs one PD per quarantine at most (docs/router.md).
QUARANTINE_S = 60.0
QUARANTINE_MAX_S = 960.0


@dataclass(eq=False)
class Engine:
    """One configured engine and its live state. The health fields are written by the rules
    in health.py only."""

    id: str
    url: str
    role: Role
    state: EngineState = EngineState.active
    model: str = ""  # the served name of the model it serves (its lane's)
    healthy: bool = False  # unknown until the first probe answers
    inflight: int = 0  # requests currently on this engine
    # work waiting on this engine, in tokens: VE embedding tokens being encoded (the load-bound
    # measure), PD prompt tokens not yet past their first token; both size call deadlines
    inflight_work: int = 0
    served: int = 0
    failures: int = 0  # calls and immediate probes that failed because of the engine
    call_failures: int = 0  # consecutive failed calls
    streak: set[Failure] = field(default_factory=set)  # their kinds
    outcomes: list[bool] = field(default_factory=list)  # the last `ratio_window` calls
    probe_failures: int = 0  # consecutive failed /health probes
    probe_successes: int = 0
    needs_serving_probe: bool = False  # ejected after a timeout: back only when it serves
    last_error: str | None = None
    last_change: float = field(default_factory=time.monotonic)
    removed: bool = False
    # VE only: a PD could not read its blocks (`blocks_unreadable`). Each such failure cost a
    # PD its engine core (docs/contract.md §3.5), so the VE stays ejected until
    # `quarantined_until` (`time.monotonic()`), however well its /health answers: nothing
    # but a PD's read tests its side channel.
    quarantined_until: float = 0.0
    unreadable: int = 0  # such failures so far; each doubles the next quarantine
    reads_ok_at: float = 0.0  # when a PD last read this VE's blocks (`time.monotonic()`)
    # PD only: when the router first had its engine core's death (vLLM's EngineDeadError
    # answer) since it last served or came back into service; a call made after it met an
    # engine core already dead (generation.py `_failed_read`)
    core_died_at: float = 0.0
    # PD only: its context length (vLLM's max_model_len), read from its `GET /v1/models` once
    # its /health answers (engine_client.py); None until then
    max_model_len: int | None = None

    @property
    def eligible(self) -> bool:
        return self.healthy and self.state is EngineState.active and not self.removed

    @property
    def quarantined(self) -> bool:
        return bool(self.quarantined_until) and time.monotonic() < self.quarantined_until

    @property
    def reads_proven(self) -> bool:
        """A PD read this VE's blocks since it last came (back) into service."""
        return self.reads_ok_at > max(self.last_change, self.quarantined_until)

    def blocks_unreadable(self, reason: str) -> float:
        """A PD failed to read this VE's blocks: out of service at once, for a quarantine
        that doubles with each such failure (`QUARANTINE_S` up to `QUARANTINE_MAX_S`).
        Returns its length."""
        self.unreadable += 1
        seconds = min(QUARANTINE_S * 2 ** (self.unreadable - 1), QUARANTINE_MAX_S)
        self.quarantined_until = time.monotonic() + seconds
        self.set_health(False, f"{reason}; quarantined {seconds:g}s")
        return seconds

    def set_health(self, healthy: bool, reason: str) -> None:
        if healthy and self.quarantined:
            return  # the health rules readmit it at their first good probe after the quarantine
        if healthy != self.healthy:
            self.healthy = healthy
            if healthy:
                self.core_died_at = 0.0  # back in service: a restarted engine
            self.last_change = time.monotonic()
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "engine %s",
                "healthy" if healthy else "ejected",
                extra={"engine": self.id, "role": self.role, "reason": reason},
            )

    def snapshot(self) -> dict:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.role,
            "state": "removed" if self.removed else self.state.value,
            "healthy": self.healthy,
            "needs_serving_probe": self.needs_serving_probe,
            "inflight": self.inflight,
            "inflight_work": self.inflight_work,
            "served": self.served,
            "failures": self.failures,
            "last_error": self.last_error,
            "quarantined_s": round(max(0.0, self.quarantined_until - time.monotonic()), 1),
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

    def max_model_len(self) -> int | None:
        """The context every eligible PD takes (the least of those known), None: none known."""
        known = [e.max_model_len for e in self.pd if e.eligible and e.max_model_len is not None]
        return min(known) if known else None

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
        return Engine(id=ep.id, url=ep.url, role=role, state=ep.state, model=cfg.model_name)

    pools = Pools(
        ve=tuple(make(ep, "ve") for ep in cfg.endpoints.ve),
        pd=tuple(make(ep, "pd") for ep in cfg.endpoints.pd),
    )
    kept = {id(e) for e in pools.all()}
    removed = [e for e in old.values() if id(e) not in kept]
    for engine in removed:
        engine.removed = True
    return pools, removed
