"""The fleet's trace store (epd_kit.plan.trace_store): the first monitoring host with
`epd_trace_store: phoenix` is epd_otlp_traces_endpoint's default for the router and every engine,
an operator's collector wins, a store without an address is refused, and only the store's host
opens its ports, to the engine and router hosts, the monitoring hosts and epd_admin_networks."""

from __future__ import annotations

from epd_kit.plan import firewall, trace_store
from tests.unit.plan.test_firewall import CLIENTS, checked, rules, three_hosts

STORE_URL = "http://10.213.0.13:6006/v1/traces"


def with_store(**fleet):
    """three_hosts + two monitoring hosts: the controller (no store) and n3 (the store)."""
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS, **fleet)
    hostvars["prom"] = {"ansible_connection": "local", "epd_bind_address": "10.213.0.1"}
    hostvars["n3"]["epd_trace_store"] = "phoenix"
    groups["epd_monitoring"] = ["prom", "n3"]
    return hostvars, groups


def engine_endpoints(result) -> set[str]:
    """Each engine's --otlp-traces-endpoint (its argv as the plan renders it)."""
    out = set()
    for host_plan in result["plan"].values():
        for engine in host_plan["engines"]:
            argv = engine["argv"]
            out.add(argv[argv.index("--otlp-traces-endpoint") + 1] if "--otlp-traces-endpoint" in argv else "")
    return out


def test_no_store_changes_nothing():
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS)
    groups["epd_monitoring"] = ["n3"]
    hostvars["n3"]["epd_trace_store"] = "none"  # the operator's explicit none wins over the default
    assert trace_store.trace_store(hostvars, groups) is None
    result = checked(hostvars, groups)
    assert result["problems"] == []
    assert result["settings"]["epd_otlp_traces_endpoint"] == ""
    assert engine_endpoints(result) == {""}


def test_no_monitoring_host_no_store():
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS)
    assert trace_store.trace_store(hostvars, groups) is None
    assert checked(hostvars, groups)["settings"]["epd_otlp_traces_endpoint"] == ""


def test_a_monitoring_host_runs_the_store_by_default():
    """epd_trace_store unset (auto): the first monitoring host the kit reaches over SSH with an
    address is the store and the fleet's collector; the controller (local connection) is passed over."""
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS)
    hostvars["prom"] = {"ansible_connection": "local", "epd_bind_address": "10.213.0.1"}
    hostvars["mon1"] = {"ansible_host": "10.213.0.9"}
    groups["epd_monitoring"] = ["prom", "mon1"]
    store = trace_store.trace_store(hostvars, groups)
    assert (store.host, store.traces_endpoint) == ("mon1", "http://10.213.0.9:6006/v1/traces")
    result = checked(hostvars, groups)
    assert result["problems"] == []
    assert result["settings"]["epd_otlp_traces_endpoint"] == "http://10.213.0.9:6006/v1/traces"
    assert engine_endpoints(result) == {"http://10.213.0.9:6006/v1/traces"}
    # the operator's collector still wins over the default store
    for host in ("n1", "n2", "n3"):
        hostvars[host]["epd_otlp_traces_endpoint"] = "http://10.213.0.1:4318/v1/traces"
    result = checked(hostvars, groups)
    assert result["settings"]["epd_otlp_traces_endpoint"] == "http://10.213.0.1:4318/v1/traces"
    assert engine_endpoints(result) == {"http://10.213.0.1:4318/v1/traces"}


def test_an_explicit_phoenix_wins_over_an_earlier_default():
    hostvars, groups = with_store()
    hostvars["mon0"] = {"ansible_host": "10.213.0.8"}  # auto, first in the group
    groups["epd_monitoring"] = ["mon0", "prom", "n3"]
    assert trace_store.trace_store(hostvars, groups).host == "n3"


def test_a_monitoring_host_the_default_cannot_use_is_passed_over_cleanly():
    """auto on a monitoring host without an address the fleet sees, or on the controller: no store,
    no problem, tracing stays off (an explicit phoenix there is refused:
    test_a_store_without_an_address_the_fleet_sees_is_refused)."""
    # the firewall off: it wants every monitoring host's address for its own rules (test_firewall)
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS, epd_firewall=False)
    hostvars["loop"] = {"ansible_host": "127.0.0.1"}
    hostvars["named"] = {"ansible_host": "mon.example.internal"}
    hostvars["prom"] = {"ansible_connection": "local", "epd_bind_address": "10.213.0.1"}
    groups["epd_monitoring"] = ["loop", "named", "prom"]
    assert trace_store.trace_store(hostvars, groups) is None
    result = checked(hostvars, groups)
    assert result["problems"] == []
    assert result["settings"]["epd_otlp_traces_endpoint"] == ""
    assert engine_endpoints(result) == {""}


def test_the_first_store_is_the_fleet_s_default_collector():
    hostvars, groups = with_store()
    store = trace_store.trace_store(hostvars, groups)
    assert (store.host, store.url, store.traces_endpoint) == ("n3", "http://10.213.0.13:6006", STORE_URL)
    result = checked(hostvars, groups)
    assert result["problems"] == []
    assert result["settings"]["epd_otlp_traces_endpoint"] == STORE_URL  # the router's tracing section
    assert engine_endpoints(result) == {STORE_URL}
    # the hostvars themselves are untouched: the default lives in the plan only
    assert "epd_otlp_traces_endpoint" not in hostvars["n1"]


def test_the_operator_s_collector_wins():
    hostvars, groups = with_store(epd_otlp_traces_endpoint="http://10.213.0.1:4318/v1/traces")
    result = checked(hostvars, groups)
    assert result["settings"]["epd_otlp_traces_endpoint"] == "http://10.213.0.1:4318/v1/traces"
    assert engine_endpoints(result) == {"http://10.213.0.1:4318/v1/traces"}


def test_ports_and_ipv6_address_of_the_store():
    hostvars, groups = with_store()
    hostvars["n3"] |= {"epd_bind_address": "fd00::13", "epd_trace_store_port": 16006}
    assert trace_store.trace_store(hostvars, groups).traces_endpoint == "http://[fd00::13]:16006/v1/traces"


def test_a_store_without_an_address_the_fleet_sees_is_refused():
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS)
    hostvars["prom"] = {"ansible_connection": "local", "epd_bind_address": "10.213.0.1"}
    hostvars["store"] = {"ansible_host": "127.0.0.1", "epd_trace_store": "phoenix"}
    groups["epd_monitoring"] = ["prom", "store"]
    problems = checked(hostvars, groups)["problems"]
    assert any(
        p.startswith("store: epd_trace_store is phoenix") and "set epd_bind_address of store" in p for p in problems
    )


def test_a_bad_store_name_is_refused():
    hostvars, groups = with_store()
    hostvars["n3"]["epd_trace_store"] = "jaeger"
    problems = checked(hostvars, groups)["problems"]
    assert any("epd_trace_store" in p and "phoenix" in p for p in problems), problems


def test_only_the_store_host_opens_its_ports_to_the_fleet_monitoring_and_admins():
    hostvars, groups = with_store(epd_admin_networks=["10.99.0.0/24"])
    n3 = rules(hostvars, groups, "n3")
    # the engine hosts n1, n2 and the router host n3 (itself: its local exporters also come in on lo),
    # the monitoring hosts (prom, n3) and the operators' networks
    # (merged for nft: 10.213.0.12 and .13 are one /31)
    assert n3["the trace store"] == ([4317, 6006], ["10.99.0.0/24", "10.213.0.1", "10.213.0.11", "10.213.0.12/31"])
    assert "the trace store" not in rules(hostvars, groups, "n1")
    assert "the trace store" not in rules(hostvars, groups, "n2")
    nft = firewall.firewall_for(checked(hostvars, groups)["plan"], 18800, hostvars, groups, "n3")["nft"]
    assert "tcp dport { 4317, 6006 } ip saddr @trace_store_v4 accept" in nft
    assert "tcp dport { 4317, 6006 } reject with tcp reset" in nft


def test_a_dedicated_store_host_gets_the_kit_s_table_with_the_store_s_rule_alone():
    """A monitoring host that is no engine, router or load-balancer host and runs the store (here by
    default) gets the kit's table from the observability role: the store's two ports, open to the
    engine and router hosts, the monitoring hosts and the operators' networks; nothing else."""
    hostvars, groups = three_hosts(epd_client_networks=CLIENTS, epd_admin_networks=["10.99.0.0/24"])
    hostvars["prom"] = {"ansible_connection": "local", "epd_bind_address": "10.213.0.1"}
    hostvars["mon1"] = {"ansible_host": "10.213.0.9"}
    groups["epd_monitoring"] = ["prom", "mon1"]
    assert firewall.dedicated_store_host(hostvars, groups) == "mon1"
    assert rules(hostvars, groups, "mon1") == {
        "the trace store": ([4317, 6006], ["10.99.0.0/24", "10.213.0.1", "10.213.0.9", "10.213.0.11", "10.213.0.12/31"])
    }
    result = checked(hostvars, groups)
    summary = firewall.firewall_summary(result["plan"], result["settings"]["epd_router_port"], hostvars, groups)
    assert [line for line in summary if line.startswith("mon1:")] == [
        "mon1: tcp 4317,6006 (the trace store) from 10.99.0.0/24, 10.213.0.1, 10.213.0.9, 10.213.0.11, 10.213.0.12/31"
    ]


def test_no_table_of_its_own_for_a_store_on_a_fleet_host_or_on_the_controller():
    hostvars, groups = with_store()  # the store on n3, the router host: the firewall plays cover it
    assert firewall.dedicated_store_host(hostvars, groups) is None
    hostvars["n3"]["epd_trace_store"] = "none"
    hostvars["prom"]["epd_trace_store"] = "phoenix"  # asked for on the controller itself
    assert trace_store.trace_store(hostvars, groups).host == "prom"
    assert firewall.dedicated_store_host(hostvars, groups) is None


def test_plan_says_where_the_traces_go():
    """plan.yml's TRACES line, from the plan's endpoint: the store, the operator's collector beside a
    store that gets nothing, a collector alone, or off."""
    hostvars, groups = with_store()
    endpoint = checked(hostvars, groups)["settings"]["epd_otlp_traces_endpoint"]
    assert trace_store.traces_summary(hostvars, groups, endpoint) == (
        f"TRACES: to the trace store on n3 (Phoenix, {STORE_URL.removesuffix('/v1/traces')})"
    )
    mine = "http://10.213.0.1:4318/v1/traces"
    assert trace_store.traces_summary(hostvars, groups, mine).startswith(f"TRACES: to {mine} (your collector); the")
    hostvars["n3"]["epd_trace_store"] = "none"
    assert trace_store.traces_summary(hostvars, groups, mine) == f"TRACES: to {mine} (your collector); no trace store"
    assert trace_store.traces_summary(hostvars, groups, "").startswith("TRACES: off: no collector")
