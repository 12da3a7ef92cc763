"""router.yaml's admin section from the plan (docs/security.md "Operator endpoints"): loopback
and the router host's own address always; epd_admin_networks, else the monitoring hosts'
addresses; a load balancer's address never by default (behind HAProxy every client has it)."""

from __future__ import annotations

from epd_kit.plan.router_config import admin_networks_of

LOOPBACK = ["127.0.0.0/8", "::1/128"]


def test_the_default_is_the_monitoring_hosts_and_the_router_itself():
    got = admin_networks_of(None, "10.0.0.13", ["10.0.0.20", "prometheus.internal", ""], [])
    assert got == [*LOOPBACK, "10.0.0.13/32", "10.0.0.20/32"]  # a name is skipped: the router compares addresses


def test_a_load_balancer_is_never_taken_by_default():
    assert admin_networks_of(None, "0.0.0.0", ["10.0.0.30", "10.0.0.20"], ["10.0.0.30"]) == [*LOOPBACK, "10.0.0.20/32"]


def test_the_inventory_networks_replace_the_monitoring_hosts():
    got = admin_networks_of(["10.1.0.0/16", "127.0.0.0/8"], "fd00::13", ["10.0.0.20"], [])
    assert got == [*LOOPBACK, "fd00::13/128", "10.1.0.0/16"]
