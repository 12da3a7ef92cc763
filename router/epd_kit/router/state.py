"""The router's live state: the running config and the engine pool snapshot, shared by every
part of the request path and swapped as a whole by a reload."""

from __future__ import annotations

from dataclasses import dataclass

from epd_kit.router.errors import RouterError
from epd_kit.router.pools import Pools
from epd_kit.router_yaml import RouterConfig


@dataclass
class RouterState:
    """Readers take `cfg` and `pools` at the moment they need them; a reload assigns each
    once, so any request sees either the old or the new value, never a mix within one."""

    cfg: RouterConfig
    pools: Pools
    draining: bool = False  # SIGTERM received: /ready says 503, requests still served

    @property
    def ready(self) -> bool:
        encoders = self.cfg.endpoints.text_only or bool(self.pools.eligible_ve())
        return not self.draining and encoders and bool(self.pools.eligible_pd())

    def not_ready_reason(self) -> str:
        if self.draining:
            return "router is shutting down"
        parts = []
        pools = {"VE": self.pools.ve, "PD": self.pools.pd}
        if self.cfg.endpoints.text_only:
            del pools["VE"]
        for role, engines in pools.items():
            if not any(e.eligible for e in engines):
                parts.append(f"no healthy active {role} ({len(engines)} configured)")
        return "; ".join(parts) or "ready"

    def retry_after_s(self) -> float:
        """When a client refused for lack of engines should try again: one health round."""
        return max(1.0, self.cfg.health.interval_s)

    def not_ready_error(self) -> RouterError:
        return RouterError(503, f"not ready: {self.not_ready_reason()}", retry_after=self.retry_after_s())
