"""The epd.kit observability filter: Prometheus scrape targets from the plan, a shim over
epd_kit.plan.observability (installed or the collection's bundled copy, as epd_kit.py loads it)."""

from __future__ import annotations

import importlib

from ansible.errors import AnsibleFilterError
from ansible_collections.epd.kit.plugins.filter.epd_kit import plan

observability = importlib.import_module(f"{plan.__name__}.observability")


def scrape_files(fleet_plan, hostvars, router_hosts, router_port):
    """`epd_fleet_plan | epd.kit.epd_scrape_files(hostvars, groups['epd_router'], port)` ->
    {jobs: {epd-engines: [file_sd entries], epd-router: [...]}, loopback: [targets on loopback]}."""
    try:
        return observability.scrape_files(plan.plain(fleet_plan), hostvars, list(router_hosts), int(router_port))
    except (KeyError, TypeError, ValueError) as error:
        raise AnsibleFilterError(f"epd scrape targets: {error!r}") from None


class FilterModule:
    """Prometheus file_sd documents for the fleet."""

    def filters(self):
        return {"epd_scrape_files": scrape_files}
