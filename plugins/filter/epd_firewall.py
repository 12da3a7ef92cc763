"""The epd.kit firewall filters: the fleet's access rules from the plan, a shim over
epd_kit.plan.firewall (installed or the collection's bundled copy, as epd_kit.py loads it)."""

from __future__ import annotations

import importlib

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


def summary(fleet_plan, router_port, hostvars, groups):
    """plan.yml's lines: each host's guarded ports and who may connect, or that the kit installs none."""
    try:
        return firewall.firewall_summary(plan.plain(fleet_plan), int(router_port), hostvars, plan.plain(groups))
    except plan.EpdPlanError as error:
        raise AnsibleFilterError(f"epd firewall: {error}") from None


class FilterModule:
    """The kit's nftables table per host, and plan.yml's summary of it."""

    def filters(self):
        return {"epd_firewall": host_rules, "epd_firewall_summary": summary}
