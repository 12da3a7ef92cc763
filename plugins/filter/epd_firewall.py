"""The epd.kit firewall filters: the fleet's access rules from the plan, a shim over
epd_kit.plan.firewall (installed or the collection's bundled copy, as epd_kit.py loads it)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError
from ansible_collections.epd.kit.plugins.filter.epd_kit import plan

firewall = importlib.import_module(f"{plan.__name__}.firewall")


def host_rules(fleet_plan, router_port, hostvars, groups, host, loaded=None):
    """`epd_fleet_plan | epd.kit.epd_firewall(port, hostvars, groups, inventory_hostname, loaded_file)`
    -> {enabled, nft (the table's text), rules}; loaded_file: the file loaded now, whose sets are kept."""
    try:
        return firewall.firewall_for(
            plan.plain(fleet_plan), int(router_port), hostvars, plan.plain(groups), str(host), loaded or None
        )
    except plan.EpdPlanError as error:
        raise AnsibleFilterError(f"epd firewall: {error}") from None


class _Remembered(Mapping):
    """hostvars whose hosts' variables are each templated once: the firewall reads a few variables of
    every host for every host it writes (Ansible's hostvars template a value on every read)."""

    def __init__(self, hostvars) -> None:
        self._hostvars, self._hosts = hostvars, {}

    def __getitem__(self, host):
        if host not in self._hosts:
            self._hosts[host] = _RememberedHost(self._hostvars[host])
        return self._hosts[host]

    def __iter__(self):
        return iter(self._hostvars)

    def __len__(self) -> int:
        return len(self._hostvars)

    def __contains__(self, host) -> bool:
        return host in self._hostvars


class _RememberedHost(Mapping):
    def __init__(self, variables) -> None:
        self._variables, self._values = variables, {}

    def __getitem__(self, name):
        if name not in self._values:
            self._values[name] = self._variables[name]
        return self._values[name]

    def __iter__(self):
        return iter(self._variables)

    def __len__(self) -> int:
        return len(self._variables)

    def __contains__(self, name) -> bool:
        return name in self._values or name in self._variables


def share_rules(fleet_plan, router_port, hostvars, groups, hosts):
    """`epd_fleet_plan | epd.kit.epd_firewall_hosts(port, hostvars, groups, hosts)` -> {host: as epd_firewall}
    of a first deploy (no table loaded): render.yml's share of the hosts in one call."""
    try:
        return firewall.firewall_for_hosts(
            plan.plain(fleet_plan), int(router_port), _Remembered(hostvars), plan.plain(groups), list(hosts)
        )
    except plan.EpdPlanError as error:
        raise AnsibleFilterError(f"epd firewall: {error}") from None


def summary(fleet_plan, router_port, hostvars, groups):
    """plan.yml's lines: each host's guarded ports and who may connect, or that the kit installs none."""
    try:
        return firewall.firewall_summary(plan.plain(fleet_plan), int(router_port), hostvars, plan.plain(groups))
    except plan.EpdPlanError as error:
        raise AnsibleFilterError(f"epd firewall: {error}") from None


class FilterModule:
    """The kit's nftables table per host, and plan.yml's summary of it."""

    def filters(self):
        return {"epd_firewall": host_rules, "epd_firewall_hosts": share_rules, "epd_firewall_summary": summary}
