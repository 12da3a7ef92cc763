"""What the ops playbooks compute: which engines to act on, the rolling-restart queue, the status table."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from .errors import EpdPlanError

# `-e engines=pd-0,epd-ve-1,epd-trn2-b-pd-0`: instances (on every host of the play) or engine ids
# (`<prefix>-<instance>` in a one-host fleet, `<prefix>-<label>-<instance>` on the host labelled so).
_INSTANCE = re.compile(r"^(?:(.*?)-)?((?:ve|pd)-[0-9]+)$")
STATUS_HEADER = ("HOST", "UNIT", "STATE", "HEALTH")


def engine_selection(engines: str | None) -> list[str]:
    """The instances named by a comma-separated list of instances or engine ids (empty: none named)."""
    return [_INSTANCE.sub(r"\2", name) for name in _names(engines)]


def _names(engines: str | None) -> list[str]:
    return [name for name in (name.strip() for name in (engines or "").split(",")) if name]


def _selects(name: str, instance: str, label: str | None) -> bool:
    """Whether a selected name means this host's `instance`: the instance itself (on every host), or
    an engine id of it; with a label (a fleet of several engine hosts) the id must carry it."""
    match = _INSTANCE.fullmatch(name)
    if match is None or match.group(2) != instance:
        return False
    return match.group(1) is None or label is None or match.group(1).endswith(f"-{label}")


def deployed_engines(env_files: Iterable[str], engines: str | None = None, label: str | None = None) -> list[str]:
    """The engine instances deployed on a host (its <instance>.env files), limited to the selection.
    label: the host's engine id label in a fleet of several engine hosts (epd_engine_id_label, else
    its inventory name); None in a one-host fleet, whose ids carry no label."""
    deployed = sorted(PurePosixPath(path).name.removesuffix(".env") for path in env_files)
    wanted = _names(engines)
    return [i for i in deployed if not wanted or any(_selects(name, i, label) for name in wanted)]


def rolling_queue(plan: Mapping[str, Mapping[str, Any]], engines: str | None = None) -> list[dict[str, str]]:
    """The engines to restart one by one, in plan order: {host, instance, engine_id} each."""
    wanted = _names(engines)
    planned = [(host, e) for host, host_plan in plan.items() for e in host_plan["engines"]]
    known = {e["instance"] for _, e in planned} | {e["engine_id"] for _, e in planned}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise EpdPlanError(
            f"unknown engines {', '.join(unknown)}; planned are {', '.join(e['engine_id'] for _, e in planned)}"
        )
    return [
        {"host": host, "instance": e["instance"], "engine_id": e["engine_id"]}
        for host, e in planned
        if not wanted or e["instance"] in wanted or e["engine_id"] in wanted
    ]


def status_rows(
    host: str,
    instances: Sequence[str],
    states: Sequence[str],
    health: Sequence[Mapping[str, Any]],
    router_ready: Mapping[str, Any] | None = None,
) -> list[list[str]]:
    """One host's status rows: [host, unit, state, health] per engine, then the router's.

    `states` are `systemctl is-active` lines (engines, then the router), `health` the engines'
    /health probes and `router_ready` the router's /ready probe (None: no router on this host).
    """

    def state(index: int) -> str:
        return states[index] if index < len(states) else "?"

    rows = []
    for index, instance in enumerate(instances):
        code = health[index].get("status", -1) if index < len(health) else -1
        rows.append([host, f"epd-engine@{instance}.service", state(index), "ok" if code == 200 else f"down ({code})"])
    if router_ready is not None:
        code = router_ready.get("status", -1)
        rows.append(
            [host, "epd-router.service", state(len(instances)), "ready" if code == 200 else f"not ready ({code})"]
        )
    return rows or [[host, "-", "no EPD units", "-"]]


def status_table(
    rows_by_host: Mapping[str, Any], engine_hosts: Sequence[str], router_hosts: Sequence[str]
) -> list[str]:
    """The status table of every host: engine hosts first; a host without rows was unreachable."""
    hosts = list(engine_hosts) + [h for h in router_hosts if h not in engine_hosts]
    rows: list[Sequence[str]] = [STATUS_HEADER]
    for host in hosts:
        rows += rows_by_host.get(host) or [[host, "-", "unreachable", "-"]]
    return [f"{host:<24} {unit:<30} {state:<12} {health}" for host, unit, state, health in rows]
