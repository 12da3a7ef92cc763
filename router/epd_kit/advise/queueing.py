"""The queueing model: each pool is an M/M/c queue (Poisson arrivals, exponential service,
c servers sharing one FIFO queue).

Servers: a VE encodes one request at a time (the kit runs every VE with --max-num-seqs 1,
plan/command.py; the simulator's VE holds one lock per request, sim/ve.py), so a VE pool of n
engines has c = n. A PD runs up to --max-num-seqs sequences together (continuous batching), so a
PD pool of n engines has c = n x epd_max_num_seqs slots. The per-request service time S is not
measured directly (the router sees time in stage = service + queueing): it is the S for which
the model's mean time in stage equals the measured one. docs/advisor.md states the limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A fitted pool never reaches utilisation 1: the model has no steady state there.
MAX_FIT_UTILISATION = 0.995


def erlang_c(servers: int, offered: float) -> float:
    """P(an arrival waits) in M/M/c with `offered` = arrival rate x service time (Erlangs)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocking = 1.0  # Erlang B by its stable recursion
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    rho = offered / servers
    return blocking / (1 - rho * (1 - blocking))


def mean_time_in_system(rate: float, service_s: float, servers: int) -> float:
    """W = S + C(c, a) S / (c - a); infinite when the pool cannot keep up."""
    offered = rate * service_s
    if servers <= 0 or offered >= servers:
        return math.inf
    return service_s + erlang_c(servers, offered) * service_s / (servers - offered)


def fit_service_time(rate: float, time_in_stage_s: float, servers: int) -> float:
    """The service time S whose modelled mean time in stage is the measured one (bisection:
    W grows monotonically with S). With no arrivals S is the measured time itself."""
    if rate <= 0 or servers <= 0:
        return time_in_stage_s
    low, high = 0.0, MAX_FIT_UTILISATION * servers / rate
    if mean_time_in_system(rate, high, servers) <= time_in_stage_s:
        return high  # saturated: the queue grew during the window
    for _ in range(100):
        mid = (low + high) / 2
        if mean_time_in_system(rate, mid, servers) < time_in_stage_s:
            low = mid
        else:
            high = mid
    return (low + high) / 2


@dataclass(frozen=True)
class PoolModel:
    """One pool under the model: arrivals per second, service time, servers."""

    rate: float
    service_s: float
    servers: int

    @property
    def utilisation(self) -> float:
        """The busy fraction of the pool's servers (may exceed 1 when the layout cannot keep up)."""
        if self.servers <= 0:
            return math.inf if self.rate > 0 else 0.0
        return self.rate * self.service_s / self.servers

    @property
    def time_in_stage_s(self) -> float:
        if self.rate <= 0:
            return self.service_s
        return mean_time_in_system(self.rate, self.service_s, self.servers)

    @property
    def queueing_s(self) -> float:
        return self.time_in_stage_s - self.service_s

    @property
    def capacity_per_s(self) -> float:
        """Arrivals per second the pool completes at utilisation 1."""
        return math.inf if self.service_s <= 0 else self.servers / self.service_s

    def with_servers(self, servers: int) -> PoolModel:
        return PoolModel(self.rate, self.service_s, servers)

    def scaled(self, load: float) -> PoolModel:
        """The pool at `load` times its arrival rate (same service time)."""
        return PoolModel(self.rate * load, self.service_s, self.servers)
