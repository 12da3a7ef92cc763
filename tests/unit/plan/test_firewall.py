"""The access rules from the plan (epd_kit.plan.firewall): who may open a connection to each kit
port, per role and per host, the inventory problems that refuse a fleet, the opening apply's union
with the loaded table, and the rendered nftables file (a golden, checked by `nft -c` when this
machine can run it in a network namespace of its own)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from epd_kit import plan as planner
from epd_kit.plan import firewall
from epd_kit.plan.variables import VARIABLES

REPO = Path(__file__).resolve().parents[3]
GOLDEN = REPO / "tests/golden/firewall-n1.nft"
CLIENTS = ["10.213.0.1/32"]
MODEL = {"epd_model": "/models/m"}


def three_hosts(**fleet: Any) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """inventory/sandbox/three-host's shape: n1 2 VE, n2 2 PD, n3 the router."""
    common = {**MODEL, **fleet}
    hostvars = {
        "n1": {**common, "ansible_host": "10.213.0.11", "epd_bind_address": "10.213.0.11", "epd_num_ve": 2},
        "n2": {**common, "ansible_host": "10.213.0.12", "epd_bind_address": "10.213.0.12", "epd_num_pd": 2},
        "n3": {**common, "ansible_host": "10.213.0.13", "epd_bind_address": "10.213.0.13"},
    }
    return hostvars, {"epd_engines": ["n1", "n2"], "epd_router": ["n3"]}


def checked(hostvars, groups) -> dict[str, Any]:
    return planner.check_inventory(hostvars, groups, None, set(VARIABLES))


def rules(hostvars, groups, host: str, loaded: str | None = None) -> dict[str, tuple[list[int], list[str]]]:
    """{what: (ports, allowed sources)} of `host`."""
    result = checked(hostvars, groups)
    assert result["problems"] == []
    port = result["settings"]["epd_router_port"]
    out = firewall.firewall_for(result["plan"], port, hostvars, groups, host, loaded)
    assert out["enabled"]
    return {r["what"].split(":")[0]: (r["ports"], r["sources"]) for r in out["rules"]}


def test_each_port_accepts_only_its_peers():
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS)
    assert rules(hostvars, groups, "n1") == {
        "engine HTTP": ([18300, 18301], ["10.213.0.13"]),  # the router
        "VE side channels": ([*range(14600, 14608)], ["10.213.0.12"]),  # the PD host
    }
    assert rules(hostvars, groups, "n2") == {"engine HTTP": ([18100, 18101], ["10.213.0.13"])}
    assert rules(hostvars, groups, "n3") == {"the router": ([18800], ["10.213.0.1"])}


def test_the_nixl_transport_opens_the_ucx_ports_of_the_ve_hosts_to_the_pd_hosts_only():
    cpu = {"epd_engine_backend": "vllm-cpu", "epd_ve_tp": 1, "epd_ve_dp": 1, "epd_pd_tp": 1}
    hostvars, groups = three_hosts(
        epd_client_networks=CLIENTS, epd_vllm_cpu_ec_transport="nixl", epd_vllm_cpu_ucx_port_range="14700-14703", **cpu
    )
    assert rules(hostvars, groups, "n1") == {
        "engine HTTP": ([18300, 18301], ["10.213.0.13"]),
        "VE side channels": ([14600, 14601], ["10.213.0.12"]),
        "UCX (NIXL reads of encoder outputs)": ([14700, 14701, 14702, 14703], ["10.213.0.12"]),  # the PD host
    }
    assert rules(hostvars, groups, "n2") == {"engine HTTP": ([18100, 18101], ["10.213.0.13"])}
    # on Neuron the variable is vllm-cpu's alone: no UCX port opens (NIXL rides EFA there)
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS, epd_vllm_cpu_ec_transport="nixl")
    assert "UCX (NIXL reads of encoder outputs)" not in rules(hostvars, groups, "n1")


def test_engine_hosts_close_every_port_the_plan_did_not_open_and_router_hosts_stay_open():
    """An engine opens listeners the plan never named (vLLM's torch.distributed store on a random
    port of every address, UCX's on a PD host): an engine host's chain drops by default and resets a
    new TCP connection to any other port; SSH, loopback, ICMP and replies pass. The router host only
    guards its port, as before."""
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS)
    hostvars["n2"]["ansible_port"] = 2222
    plan = checked(hostvars, groups)["plan"]
    sources, _ = firewall.fleet_sources(plan, hostvars, groups)
    n1, n2, n3 = (firewall.host_firewall(plan, 18800, hostvars, groups, h, sources) for h in ("n1", "n2", "n3"))
    assert (n1.closed, n1.open_ports) == (True, (22,))
    assert (n2.closed, n2.open_ports) == (True, (22, 2222))
    assert (n3.closed, n3.open_ports) == (False, ())
    text = n2.nft()
    assert "policy drop;" in text and "\t\ttcp dport { 22, 2222 } accept\n" in text
    assert "ct state established,related accept" in text and "meta l4proto { icmp, icmpv6 } accept" in text
    # the catch-all reset comes after every planned rule
    assert text.rindex("meta l4proto tcp reject with tcp reset") > text.rindex("@engine_http_v6 accept")
    assert "policy accept;" in n3.nft() and "meta l4proto tcp reject" not in n3.nft()
    summary = firewall.firewall_summary(plan, 18800, hostvars, groups)
    assert "n2: every other port closed (an engine host; SSH 22,2222 open)" in summary
    assert not any(line.startswith("n3: every other port") for line in summary)


def test_a_one_machine_fleet_opens_the_router_port_to_anyone_on_its_closed_engine_host():
    hostvars = {"n1": {**MODEL, "ansible_host": "10.213.0.11", "epd_num_ve": 1, "epd_num_pd": 2}}
    groups = {"epd_engines": ["n1"], "epd_router": ["n1"]}
    plan = checked(hostvars, groups)["plan"]
    sources, _ = firewall.fleet_sources(plan, hostvars, groups)
    n1 = firewall.host_firewall(plan, 18800, hostvars, groups, "n1", sources)
    assert (n1.closed, n1.open_ports) == (True, (22, 18800))
    assert "\t\ttcp dport { 22, 18800 } accept\n" in n1.nft()


def test_monitoring_hosts_reach_the_engines_and_the_router_and_need_an_address():
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS)
    groups["epd_monitoring"] = ["prom"]
    hostvars["prom"] = {"ansible_connection": "local"}
    assert checked(hostvars, groups)["problems"] == [
        "prom: the firewall lets the monitoring hosts in by address and prom has none the other hosts see "
        "(epd_bind_address, else ansible_host, as an IP address that is not loopback): set epd_bind_address "
        "of prom to its private address, or epd_firewall: false"
    ]
    hostvars["prom"]["epd_bind_address"] = "10.213.0.1"
    assert rules(hostvars, groups, "n2")["engine HTTP"] == ([18100, 18101], ["10.213.0.1", "10.213.0.13"])
    # the monitoring address is inside the client network: one interval
    assert rules(hostvars, groups, "n3")["the router"] == ([18800], ["10.213.0.1"])


def test_a_fleet_of_several_machines_must_name_its_client_networks():
    hostvars, groups = three_hosts()
    problems = checked(hostvars, groups)["problems"]
    assert len(problems) == 1 and problems[0].startswith("epd_client_networks is not set"), problems
    assert "epd_firewall: false" in problems[0]


def test_a_bad_client_network_is_refused():
    hostvars, groups = three_hosts(epd_client_networks=["10.0.0.0/33", "10.1.0.0/16"])
    assert checked(hostvars, groups)["problems"] == [
        "epd_client_networks: '10.0.0.0/33' is not a network (CIDR such as 10.0.0.0/16, or an address)"
    ]
    hostvars, groups = three_hosts(epd_client_networks="10.0.0.0/16")
    (problem,) = checked(hostvars, groups)["problems"]
    assert problem.startswith("every host: epd_client_networks must be a list"), problem


def test_one_machine_lets_any_client_reach_the_router_and_guards_the_engines():
    hostvars = {"n1": {**MODEL, "ansible_host": "10.213.0.11", "epd_num_ve": 1, "epd_num_pd": 2}}
    groups = {"epd_engines": ["n1"], "epd_router": ["n1"]}
    assert rules(hostvars, groups, "n1") == {
        "engine HTTP": ([18100, 18101, 18300], ["10.213.0.11"]),  # the router: this host (loopback passes anyway)
        "VE side channels": ([14600, 14601, 14602, 14603], ["10.213.0.11"]),
    }
    summary = firewall.firewall_summary(checked(hostvars, groups)["plan"], 18800, hostvars, groups)
    assert "n1: tcp 18800 (the router) from anyone (one machine: epd_client_networks unset)" in summary


def test_firewall_false_installs_nothing_and_says_so_loudly():
    hostvars, groups = three_hosts(epd_firewall=False)  # and no epd_client_networks: nothing to refuse
    result = checked(hostvars, groups)
    assert result["problems"] == []
    assert firewall.firewall_for(result["plan"], 18800, hostvars, groups, "n1") == {
        "enabled": False,
        "nft": "",
        "rules": [],
    }
    (line,) = firewall.firewall_summary(result["plan"], 18800, hostvars, groups)
    assert line.startswith("FIREWALL: epd_firewall is false: the kit installs NO access rules")


def test_load_balancers_reach_the_routers_and_clients_reach_haproxy_and_monitoring_its_statistics():
    hostvars, groups = three_hosts(epd_client_networks=["192.168.0.0/24"])
    hostvars["lb"] = {**MODEL, "ansible_host": "10.213.0.14"}
    hostvars["prom"] = {"ansible_host": "10.213.0.15"}
    groups |= {"epd_loadbalancer": ["lb"], "epd_monitoring": ["prom"]}
    # the load balancer .14 and the monitoring host .15 make one interval
    assert rules(hostvars, groups, "n3")["the router"] == ([18800], ["10.213.0.14/31", "192.168.0.0/24"])
    assert rules(hostvars, groups, "lb") == {
        "HAProxy": ([8080], ["192.168.0.0/24"]),
        "HAProxy's statistics": ([8404], ["10.213.0.15"]),
    }
    hostvars["lb"] |= {"epd_haproxy_stats_port": None, "epd_haproxy_port": 22}  # SSH is never touched
    assert rules(hostvars, groups, "lb") == {}


def test_the_admin_networks_reach_the_router_port_but_no_engine():
    """epd_admin_networks read the router's /metrics and /pools (docs/security.md "Operator endpoints")."""
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS)
    plan = checked(hostvars, groups)["plan"]
    for variables in hostvars.values():
        variables["epd_admin_networks"] = ["172.16.0.0/12", "not a network"]  # its own check reports the second
    sources, problems = firewall.fleet_sources(plan, hostvars, groups)
    assert problems == [] and sources.admin == ("172.16.0.0/12",)
    assert firewall.host_firewall(plan, 18800, hostvars, groups, "n3", sources).sources == {
        "router": ("10.213.0.1", "172.16.0.0/12")
    }
    assert firewall.host_firewall(plan, 18800, hostvars, groups, "n2", sources).sources == {
        "engine_http": ("10.213.0.13",)
    }


def test_the_ssh_port_of_a_host_is_never_guarded():
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS, epd_router_port=2222)
    hostvars["n3"]["ansible_port"] = 2222
    assert rules(hostvars, groups, "n3") == {}


def test_the_opening_apply_keeps_the_loaded_sources_and_the_last_drops_them():
    """A PD host added (n4) is let in before its engines start; a removed one (10.213.0.19) keeps its
    access until the plan alone is applied, after its drain."""
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS)
    loaded = firewall.firewall_for(checked(hostvars, groups)["plan"], 18800, hostvars, groups, "n1")["nft"]
    loaded = loaded.replace('"side_channel": ["10.213.0.12"]', '"side_channel": ["10.213.0.12", "10.213.0.19"]')
    hostvars["n4"] = {**hostvars["n2"], "ansible_host": "10.213.0.14", "epd_bind_address": "10.213.0.14"}
    groups["epd_engines"].append("n4")
    opening = rules(hostvars, groups, "n1", loaded)["VE side channels"][1]
    assert opening == ["10.213.0.12", "10.213.0.14", "10.213.0.19"]
    assert rules(hostvars, groups, "n1")["VE side channels"][1] == ["10.213.0.12", "10.213.0.14"]


def test_overlapping_sources_are_merged_for_nft():
    assert firewall.collapse(["10.1.2.3", "10.0.0.0/8", "fd00::1", "10.213.0.1/32"]) == ("10.0.0.0/8", "fd00::1")


def test_the_rendered_table_is_the_golden_and_records_its_sources():
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS)
    text = firewall.firewall_for(checked(hostvars, groups)["plan"], 18800, hostvars, groups, "n1")["nft"]
    if os.environ.get("EPD_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "EPD_UPDATE_GOLDEN=1 rewrites tests/golden/firewall-n1.nft"
    assert firewall.read_sources(text) == {"engine_http": ["10.213.0.13"], "side_channel": ["10.213.0.12"]}
    assert firewall.read_sources(None) == {}


def nft_in_own_namespace(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["unshare", "--net", "sh", "-c", " ".join(args)], capture_output=True, text=True, timeout=30, check=False
    )


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft"), reason="nft -c needs root and nftables")
def test_nft_accepts_the_rendered_table_and_a_reload_replaces_it(tmp_path):
    """In a network namespace of its own: the file loads twice (create, delete, define again) and the
    operator's table beside it stays."""
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS, epd_firewall=True)
    plan = checked(hostvars, groups)["plan"]
    (tmp_path / "n1.nft").write_text(firewall.firewall_for(plan, 18800, hostvars, groups, "n1")["nft"])
    operator = "nft add table inet theirs && nft add chain inet theirs input '{ type filter hook input priority 0; }'"
    load = f"nft -c -f {tmp_path}/n1.nft && nft -f {tmp_path}/n1.nft && nft -f {tmp_path}/n1.nft"
    result = nft_in_own_namespace(f"{operator} && {load} && nft list tables")
    if "unshare failed" in result.stderr or "Operation not permitted" in result.stderr:
        pytest.skip(f"no network namespace here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["table", "inet", "theirs", "table", "inet", "epd_kit"]
