"""Prometheus scrape targets for the fleet, derived from the plan (docs/observability.md).

Every engine of the plan and every router host becomes one target with the labels the
dashboard and the alert rules select on: `host` (inventory name), `role` (ve | pd | router),
`engine_id` (empty for a router) and `instance` (the systemd instance: `pd-0`, or `router`).
The targets are written as Prometheus `file_sd` JSON, one file per job, so a changed inventory
changes the files and an engine that left the plan leaves its file.

Stdlib only, like the rest of epd_kit.plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .defaults import HOST_DEFAULTS
from .net import WILDCARD_ADDRESSES, is_loopback

ENGINES_JOB = "epd-engines"
ROUTER_JOB = "epd-router"
ROUTER_INSTANCE = "router"


@dataclass(frozen=True)
class ScrapeTarget:
    """One /metrics endpoint and the labels Prometheus attaches to every series it scrapes there."""

    address: str  # host:port as Prometheus dials it
    host: str
    role: str
    engine_id: str
    instance: str

    @property
    def job(self) -> str:
        return ROUTER_JOB if self.role == "router" else ENGINES_JOB

    @property
    def loopback(self) -> bool:
        return is_loopback(self.address.rsplit(":", 1)[0].strip("[]"))

    def labels(self) -> dict[str, str]:
        return {key: value for key, value in asdict(self).items() if key != "address"}


def _dial_address(bind_address: str, host: str, hostvars: Mapping[str, Any], port: int) -> str:
    """Where a Prometheus elsewhere reaches a service: a wildcard bind means the host's own address."""
    address = bind_address
    if address in WILDCARD_ADDRESSES:
        address = str(hostvars.get(host, {}).get("ansible_host") or host)
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def router_listen_address(host_vars: Mapping[str, Any]) -> str:
    """The router's listen address as the router role derives it: its own setting, else the host's bind address."""
    listen = host_vars.get("epd_router_listen_host") or host_vars.get("epd_bind_address")
    return str(listen or HOST_DEFAULTS["epd_bind_address"])


def scrape_targets(
    plan: Mapping[str, Mapping[str, Any]],
    hostvars: Mapping[str, Any],
    router_hosts: Sequence[str],
    router_port: int,
) -> list[ScrapeTarget]:
    """Every engine (plan order) and every router host (inventory order)."""
    targets = [
        ScrapeTarget(
            address=_dial_address(str(engine["host"]), name, hostvars, int(engine["port"])),
            host=name,
            role=str(engine["role"]),
            engine_id=str(engine["engine_id"]),
            instance=str(engine["instance"]),
        )
        for name, host_plan in plan.items()
        for engine in host_plan["engines"]
    ]
    for name in router_hosts:
        listen = router_listen_address(hostvars.get(name, {}))
        targets.append(
            ScrapeTarget(
                address=_dial_address(listen, name, hostvars, int(router_port)),
                host=name,
                role="router",
                engine_id="",
                instance=ROUTER_INSTANCE,
            )
        )
    return targets


def file_sd(targets: Sequence[ScrapeTarget], job: str) -> list[dict[str, Any]]:
    """The file_sd document of one job: one entry per target (its own labels)."""
    return [{"targets": [t.address], "labels": t.labels()} for t in targets if t.job == job]


def scrape_files(
    plan: Mapping[str, Mapping[str, Any]],
    hostvars: Mapping[str, Any],
    router_hosts: Sequence[str],
    router_port: int,
) -> dict[str, Any]:
    """What the observability role writes: {jobs: {job: file_sd document}, loopback: [targets]}.

    `loopback` lists the targets bound to a loopback address: only a Prometheus on that same
    host can scrape them (the role warns when the monitoring host is another one)."""
    targets = scrape_targets(plan, hostvars, router_hosts, router_port)
    return {
        "jobs": {job: file_sd(targets, job) for job in (ENGINES_JOB, ROUTER_JOB)},
        "loopback": [{"address": t.address, **t.labels()} for t in targets if t.loopback],
    }
