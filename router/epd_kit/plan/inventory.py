"""Read the planner's input from Ansible's hostvars: the fleet settings, each host, faulted cores.

Only the variables the planner knows are read (touching other hostvars would template
unrelated variables); pool settings must agree on every engine host.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .defaults import GLOBAL_DEFAULTS, HOST_DEFAULTS
from .errors import EpdPlanError
from .fleet import plan_fleet
from .hosts import read_host
from .neuron_releases import DEFAULT_RELEASE
from .settings import RELEASE_VARIABLE, Settings, read_settings
from .values import describe, plain


def _host_vars(hostvars: Mapping[str, Any], host: str) -> Mapping[str, Any]:
    if host not in hostvars:
        raise EpdPlanError(f"host {host!r} is not in the inventory")
    return hostvars[host]


def _lookup(variables: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    return {key: plain(variables[key]) for key in keys if key in variables}


def _faulted_from_facts(variables: Mapping[str, Any]) -> list[int]:
    # Ansible's hostvars: a membership test, then an item; .get() would template unrelated values
    facts = variables["ansible_facts"] if "ansible_facts" in variables else {}  # noqa: SIM401
    neuron = facts.get("epd_neuron") if isinstance(facts, Mapping) else None
    return list(plain(neuron.get("faulted_cores", []))) if isinstance(neuron, Mapping) else []


def _faulted_for(faulted: Any, host: str, variables: Mapping[str, Any]) -> list[int]:
    """faulted: {host: [cores]} or {host: <epd_neuron_facts result>}; else the host's facts."""
    if faulted is not None and not isinstance(faulted, Mapping):
        raise EpdPlanError(f"faulted must map host -> faulted cores, got {describe(faulted)}")
    if faulted and host in faulted:
        entry = plain(faulted[host])
        if isinstance(entry, Mapping):
            entry = entry.get("faulted_cores", [])
        return list(entry or [])
    return _faulted_from_facts(variables)


def fleet_settings(hostvars: Mapping[str, Any], hosts: Sequence[str]) -> Settings:
    """Settings from the engine hosts' variables; each must agree across hosts."""
    if isinstance(hosts, str) or not isinstance(hosts, (list, tuple)):
        raise EpdPlanError(f"epd_plan expects the list of engine hosts (groups['epd_engines']), got {describe(hosts)}")
    if not hosts:
        raise EpdPlanError("no engine hosts: add hosts to the epd_engines group")
    fleet_wide = {**GLOBAL_DEFAULTS, RELEASE_VARIABLE: DEFAULT_RELEASE}  # one release per fleet
    per_host = {str(h): _lookup(_host_vars(hostvars, str(h)), fleet_wide) for h in hosts}
    first = str(hosts[0])
    for key in fleet_wide:
        values = {h: v.get(key, fleet_wide[key]) for h, v in per_host.items()}
        if any(v != values[first] for v in values.values()):
            shown = ", ".join(f"{h}: {v!r}" for h, v in values.items())
            raise EpdPlanError(
                f"{key} differs between engine hosts ({shown}); "
                "pool settings are fleet-wide: set it once in group_vars/all"
            )
    return read_settings(per_host[first])


def plan_from_hostvars(
    hostvars: Mapping[str, Any], hosts: Sequence[str], faulted: Mapping[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """The fleet plan of the engine hosts `hosts` (groups['epd_engines']), in inventory order."""
    settings = fleet_settings(hostvars, hosts)
    specs = []
    for name in map(str, hosts):
        variables = _host_vars(hostvars, name)
        specs.append(
            read_host(name, _lookup(variables, HOST_DEFAULTS), settings, _faulted_for(faulted, name, variables))
        )
    return plan_fleet(settings, specs)
