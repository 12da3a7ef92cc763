"""Cross-setting rules: settings that are each legal alone but contradict each other.

Each rule is written once, here, with its reason; the inventory check (checks.py) runs them all on
the controller before any host is contacted. A rule yields lines that name the host, the
inventory variable, the value and the fix; its reason follows in brackets. Rules marked `warning`
are "legal but probably not meant": printed, never failing. docs/planner.md "Cross-setting
rules" lists them.

The timeout chain, outermost first: the client -> HAProxy (epd_haproxy_timeout_client_s,
epd_haproxy_timeout_server_s) -> the router's whole request (timeouts.total_s) -> each stage
(timeouts.ve_s, timeouts.pd_s) -> the silence allowed inside a stream (timeouts.stream_gap_s).
Each inner bound must end before the outer one, so the component that knows why answers first.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .backends import PROFILES
from .hints import did_you_mean
from .net import WILDCARD_ADDRESSES, is_loopback
from .router_check import section_default
from .variables import LOADBALANCER, MONITORING, ROUTER, VARIABLES

ENGINE = "epd_engines"
TRUE_STRINGS = frozenset({"true", "yes", "on", "1", "y", "t"})  # Ansible's `| bool`


@dataclass(frozen=True)
class Fleet:
    """What the rules read: each host's declared values (as set), the groups, the plan if there is one."""

    values: Mapping[str, Mapping[str, Any]]
    groups: Mapping[str, Sequence[str]]
    machines: Mapping[str, tuple[str, str]]  # host -> (address, ssh port), validate.machine_of
    plan: Mapping[str, Mapping[str, Any]] | None = None

    def members(self, group: str) -> list[str]:
        return [str(h) for h in self.groups.get(group) or [] if str(h) in self.values]

    def get(self, host: str, name: str) -> Any:
        value = self.values[host].get(name, VARIABLES[name].default)
        return None if isinstance(value, str) and "{{" in value else value

    def bind_address(self, host: str) -> str:
        return str(self.values[host].get("epd_bind_address", VARIABLES["epd_bind_address"].default))

    def listen_host(self, host: str) -> str:
        """The router's listen address: epd_router_listen_host, else the host's epd_bind_address."""
        return str(self.values[host].get("epd_router_listen_host", self.bind_address(host)))

    def router(self, host: str, section: str, key: str) -> tuple[Any, str]:
        """(value, the inventory variable that sets it or the router's default) of router.yaml's section.key."""
        extra = self.values[host].get("epd_router_extra_config") or {}
        if isinstance(extra.get(section), Mapping) and key in extra[section]:
            return extra[section][key], f"epd_router_extra_config.{section}.{key}"
        own = self.values[host].get(f"epd_router_{section}") or {}
        if isinstance(own, Mapping) and key in own:
            return own[key], f"epd_router_{section}.{key}"
        return section_default(section, key), f"the router's default {section}.{key}"

    def other_machine(self, a: str, b: str) -> bool:
        return self.machines[a] != self.machines[b]


@dataclass(frozen=True)
class Rule:
    name: str
    reason: str
    check: Callable[[Fleet], Iterable[str]]
    warning: bool = False


RULES: list[Rule] = []


def rule(name: str, reason: str, *, warning: bool = False) -> Callable[[Callable[[Fleet], Iterable[str]]], Any]:
    def register(check: Callable[[Fleet], Iterable[str]]) -> Callable[[Fleet], Iterable[str]]:
        RULES.append(Rule(name, reason, check, warning))
        return check

    return register


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _said(var: str, value: Any) -> str:
    """`var value`, or for the router's own default, which inventory variable would change it."""
    shown = f"{float(value):g}" if _number(value) is not None else repr(value)
    if not var.startswith("the router's default "):
        return f"{var} {shown}"
    section, key = var.removeprefix("the router's default ").split(".", 1)
    name = (
        f"epd_router_{section}.{key}"
        if f"epd_router_{section}" in VARIABLES
        else f"epd_router_extra_config.{section}.{key}"
    )
    return f"the router's {section}.{key} {shown} (its default; {name} sets it)"


# --------------------------------------------------------------------------- the timeout chain


@rule(
    "haproxy-outlasts-router",
    "HAProxy would cut a request the router may still answer: the client gets HAProxy's 504 "
    "instead of the router's own error, and the router keeps working for nobody",
)
def _haproxy_server_covers_total(fleet: Fleet) -> Iterator[str]:
    for lb in fleet.members(LOADBALANCER):
        server = _number(fleet.get(lb, "epd_haproxy_timeout_server_s"))
        for router in fleet.members(ROUTER):
            total, var = fleet.router(router, "timeouts", "total_s")
            if server is not None and _number(total) is not None and server <= float(total):
                yield (
                    f"{lb}: epd_haproxy_timeout_server_s is {server:g}, not above {_said(var, total)} on {router}: "
                    f"set epd_haproxy_timeout_server_s to at least {int(float(total)) + 60}, or lower total_s"
                )
                break


@rule(
    "client-outlasts-haproxy",
    "HAProxy's manual recommends the client timeout equal to the server timeout; a shorter one "
    "can close a client's connection while its answer is still coming",
    warning=True,
)
def _client_covers_server(fleet: Fleet) -> Iterator[str]:
    for lb in fleet.members(LOADBALANCER):
        client = _number(fleet.get(lb, "epd_haproxy_timeout_client_s"))
        server = _number(fleet.get(lb, "epd_haproxy_timeout_server_s"))
        if client is not None and server is not None and client < server:
            yield (
                f"{lb}: epd_haproxy_timeout_client_s is {client:g}, below epd_haproxy_timeout_server_s {server:g}: "
                f"set it to {server:g}"
            )


def _above(fleet: Fleet, section: str, inner: str, outer: str, strict: bool) -> Iterator[tuple[str, str, str]]:
    """(router, inner shown, outer shown) where router.yaml's section.inner exceeds (or equals) section.outer."""
    for router in fleet.members(ROUTER):
        low, low_var = fleet.router(router, section, inner)
        high, high_var = fleet.router(router, section, outer)
        if _number(low) is None or _number(high) is None:
            continue
        if float(low) > float(high) or (not strict and float(low) == float(high)):
            yield router, _said(low_var, low), _said(high_var, high)


@rule(
    "stage-within-total",
    "a stage's cap above the whole request's bound never applies: timeouts.total_s ends the request first, so "
    "the value was meant otherwise (often in another unit)",
)
def _stage_within_total(fleet: Fleet) -> Iterator[str]:
    for key in ("ve_s", "pd_s"):
        for router, stage, total in _above(fleet, "timeouts", key, "total_s", strict=True):
            if not _far_past_total(fleet, router, key):  # router-timeouts-in-seconds refuses it
                yield f"{router}: {stage} is above {total}: lower {key} to at most total_s, or raise total_s"


# a router time limit this many times the request's total_s is not a choice but another unit
WRONG_UNIT_FACTOR = 10
ROUTER_TIME_LIMITS = ("connect_s", "ve_s", "pd_s", "stream_gap_s", "shutdown_grace_s")


def _far_past_total(fleet: Fleet, router: str, key: str) -> bool:
    value = _number(fleet.router(router, "timeouts", key)[0])
    total = _number(fleet.router(router, "timeouts", "total_s")[0])
    return value is not None and total is not None and value >= WRONG_UNIT_FACTOR * total


@rule(
    "router-timeouts-in-seconds",
    "the router's time limits are seconds; one at least ten times the whole request's total_s was "
    "most likely written in milliseconds, and it never applies",
)
def _router_timeouts_in_seconds(fleet: Fleet) -> Iterator[str]:
    for router in fleet.members(ROUTER):
        total, total_var = fleet.router(router, "timeouts", "total_s")
        for key in ROUTER_TIME_LIMITS:
            value, var = fleet.router(router, "timeouts", key)
            if _far_past_total(fleet, router, key):
                times = float(value) / float(total)
                yield (
                    f"{router}: {_said(var, value)} is {times:.0f} times {_said(total_var, total)}: "
                    f"the router's timeouts are seconds ({float(value):g} ms would be {float(value) / 1000:g} s); "
                    f"set {key} in seconds, below total_s"
                )


@rule(
    "gap-within-total",
    "a stream's allowed silence as long as the whole request never detects a stalled PD",
    warning=True,
)
def _gap_within_total(fleet: Fleet) -> Iterator[str]:
    for router, gap, total in _above(fleet, "timeouts", "stream_gap_s", "total_s", strict=False):
        yield f"{router}: {gap} is not below {total}: set stream_gap_s well below total_s (the default is 30)"


@rule(
    "lb-keepalive-below-router-idle",
    "the router closes a keep-alive connection idle for listen.idle_timeout_s; a load balancer that keeps "
    "it longer reuses a closed connection and fails that request (router_yaml.py Listen)",
)
def _keepalive_below_idle(fleet: Fleet) -> Iterator[str]:
    for lb in fleet.members(LOADBALANCER):
        keep = _number(fleet.get(lb, "epd_haproxy_timeout_keep_alive_s"))
        for router in fleet.members(ROUTER):
            idle, var = fleet.router(router, "listen", "idle_timeout_s")
            if keep is not None and _number(idle) is not None and keep >= float(idle):
                yield (
                    f"{lb}: epd_haproxy_timeout_keep_alive_s is {keep:g}, not below {_said(var, idle)} on {router}: "
                    "lower epd_haproxy_timeout_keep_alive_s below it, or raise idle_timeout_s"
                )
                break


@rule(
    "stop-covers-grace",
    "systemd kills the router at epd_router_stop_timeout_s; a shutdown grace as long as that "
    "is cut short and the requests it waits for fail",
)
def _stop_covers_grace(fleet: Fleet) -> Iterator[str]:
    for router in fleet.members(ROUTER):
        stop = _number(fleet.get(router, "epd_router_stop_timeout_s"))
        grace, var = fleet.router(router, "timeouts", "shutdown_grace_s")
        if stop is not None and _number(grace) is not None and stop <= float(grace):
            yield (
                f"{router}: epd_router_stop_timeout_s is {stop:g}, not above {_said(var, grace)}: "
                f"set epd_router_stop_timeout_s to at least {int(float(grace)) + 30}, or lower shutdown_grace_s"
            )


@rule(
    "check-within-interval",
    "a health probe that may take longer than the interval between probes overlaps the next one",
    warning=True,
)
def _check_within_interval(fleet: Fleet) -> Iterator[str]:
    for lb in fleet.members(LOADBALANCER):
        timeout = _number(fleet.get(lb, "epd_haproxy_check_timeout_ms"))
        inter = _number(fleet.get(lb, "epd_haproxy_check_inter_ms"))
        if timeout is not None and inter is not None and timeout > inter:
            yield (
                f"{lb}: epd_haproxy_check_timeout_ms is {timeout:g}, above epd_haproxy_check_inter_ms {inter:g}: "
                f"set it to at most {inter:g}"
            )
    for router, timeout, interval in _above(fleet, "health", "timeout_s", "interval_s", strict=True):
        yield f"{router}: {timeout} is above {interval}: lower timeout_s to at most interval_s"


# --------------------------------------------------------------------------- addresses


@rule(
    "router-reachable-by-lb",
    "HAProxy on another machine reaches the router at its listen address; a loopback address is that machine's own",
)
def _router_reachable_by_lb(fleet: Fleet) -> Iterator[str]:
    for router in fleet.members(ROUTER):
        listen = fleet.listen_host(router)
        far = [lb for lb in fleet.members(LOADBALANCER) if fleet.other_machine(lb, router)]
        if far and is_loopback(listen):
            yield (
                f"{router}: the router listens on {listen} ({_listen_variable(fleet, router)}), which the load "
                f"balancer {far[0]} on another machine cannot reach: {_listen_fix(fleet, router)}"
            )


def _listen_variable(fleet: Fleet, router: str) -> str:
    return "epd_router_listen_host" if "epd_router_listen_host" in fleet.values[router] else "epd_bind_address"


def _listen_fix(fleet: Fleet, router: str) -> str:
    """The change that moves the router off loopback: the variable that put it there."""
    if "epd_router_listen_host" in fleet.values[router]:
        return (
            f"set epd_router_listen_host of {router} to its private address, or remove it "
            "(it defaults to epd_bind_address)"
        )
    return f"set epd_bind_address of {router} to its private address"


@rule(
    "router-reachable-by-clients",
    "epd_client_networks opens the router's port to clients on other machines, and no load balancer "
    "stands in front; a router on a loopback address answers none of them",
)
def _router_reachable_by_clients(fleet: Fleet) -> Iterator[str]:
    # fleet-wide (validate.scope_problems holds every host to one value): any host that sets it
    clients = next((v["epd_client_networks"] for v in fleet.values.values() if "epd_client_networks" in v), None)
    several = len({fleet.machines[h] for h in fleet.values}) > 1
    if not clients or not several or fleet.members(LOADBALANCER):
        return
    for router in fleet.members(ROUTER):
        listen = fleet.listen_host(router)
        if is_loopback(listen):
            yield (
                f"{router}: the router listens on {listen} ({_listen_variable(fleet, router)}) while "
                f"epd_client_networks {list(clients)} lets clients of other machines reach its port: "
                f"{_listen_fix(fleet, router)}"
            )


@rule(
    "admin-networks-exclude-load-balancers",
    "behind HAProxy every client's request comes from the load balancer's address: in the operator "
    'networks it would open /metrics and /pools to every client (docs/security.md "Operator endpoints")',
)
def _admin_networks_exclude_lb(fleet: Fleet) -> Iterator[str]:
    for router in fleet.members(ROUTER):
        networks = fleet.values[router].get("epd_admin_networks")
        if not isinstance(networks, list):
            continue
        for lb in fleet.members(LOADBALANCER):
            for address in _addresses(fleet, lb):
                for network in networks:
                    if _contains(str(network), address):
                        yield (
                            f"{router}: epd_admin_networks has {network}, which holds the load balancer {lb}'s "
                            f"address {address}: every client behind it could read /metrics and /pools; list the "
                            "operators' and monitoring hosts' own addresses instead, or read the endpoints with "
                            "the admin token (/etc/epd/admin-token)"
                        )
        return  # epd_admin_networks is fleet-wide: one router says it


def _addresses(fleet: Fleet, host: str) -> list[str]:
    """The host's IP-literal addresses the inventory gives: epd_bind_address and ansible_host."""
    found = []
    for value in (fleet.values[host].get("epd_bind_address"), fleet.machines[host][0]):
        try:
            found.append(str(ipaddress.ip_address(str(value).strip("[]"))))
        except ValueError:
            continue
    return list(dict.fromkeys(found))


def _contains(network: str, address: str) -> bool:
    try:
        return ipaddress.ip_address(address) in ipaddress.ip_network(network, strict=False)
    except ValueError:  # the router's own model refuses a malformed network, by name
        return False


@rule(
    "targets-reachable-by-monitoring",
    "Prometheus on another machine scrapes each engine and router at its listen address; a loopback "
    "address is that machine's own",
)
def _reachable_by_monitoring(fleet: Fleet) -> Iterator[str]:
    for host in dict.fromkeys([*fleet.members(ENGINE), *fleet.members(ROUTER)]):
        far = [mon for mon in fleet.members(MONITORING) if fleet.other_machine(mon, host)]
        if far and is_loopback(fleet.bind_address(host)):
            yield (
                f"{host}: epd_bind_address is {fleet.bind_address(host)}, which the monitoring host {far[0]} on "
                f"another machine cannot scrape: set it to {host}'s private address"
            )


@rule(
    "haproxy-reachable-by-clients",
    "HAProxy serves the fleet's clients; bound to loopback it serves only its own machine",
    warning=True,
)
def _haproxy_bind(fleet: Fleet) -> Iterator[str]:
    for lb in fleet.members(LOADBALANCER):
        address = fleet.values[lb].get("epd_haproxy_bind_address")
        if address is not None and is_loopback(str(address)):
            yield (
                f"{lb}: epd_haproxy_bind_address is {address}: only clients on {lb} itself can reach HAProxy; "
                "set its client-facing address"
            )


@rule(
    "one-private-address-per-machine",
    "engines, the router and the firewall find a machine by its epd_bind_address; two machines with "
    "one address send one machine's traffic to the other",
)
def _one_address(fleet: Fleet) -> Iterator[str]:
    owner: dict[str, str] = {}
    for host in fleet.values:
        address = fleet.bind_address(host).strip().lower()
        if address in WILDCARD_ADDRESSES or is_loopback(address) or "{{" in address:
            continue
        other = owner.setdefault(address, host)
        if other != host and fleet.other_machine(other, host):
            yield (
                f"{other} and {host}: both set epd_bind_address {address} but are different machines "
                f"(ansible_host {fleet.machines[other][0]}, {fleet.machines[host][0]}): "
                "give each its own private address"
            )


@rule(
    "router-listens-on-its-own-address",
    "a process can listen only on an address of its own machine",
)
def _listen_is_own(fleet: Fleet) -> Iterator[str]:
    owners = {fleet.bind_address(h).strip().lower(): h for h in fleet.values if "epd_bind_address" in fleet.values[h]}
    for router in fleet.members(ROUTER):
        listen = str(fleet.values[router].get("epd_router_listen_host", "")).strip().lower()
        other = owners.get(listen)
        if listen and other and fleet.other_machine(other, router):
            yield (
                f"{router}: epd_router_listen_host is {listen}, the epd_bind_address of {other} (another machine): "
                f"set it to {router}'s own address or remove it (it defaults to epd_bind_address)"
            )


# --------------------------------------------------------------------------- compile cache tiers


def _local_cache_dir(fleet: Fleet, host: str) -> str:
    values = fleet.values[host]
    if "epd_compile_cache_dir" in values:
        return str(values["epd_compile_cache_dir"])
    return f"{values.get('epd_cache_dir', VARIABLES['epd_cache_dir'].default)}/neuron-compile-cache"


@rule(
    "shared-tier-is-its-own",
    "the shared tier (NEURON_LIBTORCH_REMOTE_CACHE) is a mount every engine host shares; / or a "
    "directory inside the local tier would be each host's own disk",
)
def _shared_tier(fleet: Fleet) -> Iterator[str]:
    for host in fleet.members(ENGINE)[:1]:
        shared = str(fleet.get(host, "epd_compile_cache_shared_dir") or "")
        if not shared.startswith("/"):
            continue
        local = _local_cache_dir(fleet, host).rstrip("/")
        if not shared.strip("/"):
            yield (
                f"{host}: epd_compile_cache_shared_dir is '/': give a directory on the shared NFS/FSx mount, "
                "e.g. /mnt/fsx/neuron-cache"
            )
        elif (shared.rstrip("/") + "/").startswith(local + "/"):
            yield (
                f"{host}: epd_compile_cache_shared_dir {shared} is inside the local tier epd_compile_cache_dir "
                f"{local}: give a directory on the shared NFS/FSx mount, e.g. /mnt/fsx/neuron-cache"
            )


# systemd.exec(5) PrivateTmp=: the unit gets its own /tmp and /var/tmp, removed when it stops;
# templates/epd-engine@.service.j2 sets PrivateTmp=true
PRIVATE_TMP = ("/tmp", "/var/tmp")


@rule(
    "compile-cache-outside-private-tmp",
    "each engine unit has PrivateTmp=true: its /tmp and /var/tmp are its own and removed when it "
    "stops, so a cache there is shared with no other engine and every restart compiles again",
)
def _cache_outside_private_tmp(fleet: Fleet) -> Iterator[str]:
    for host in fleet.members(ENGINE):
        values = fleet.values[host]
        dirs = {
            "epd_compile_cache_dir" if "epd_compile_cache_dir" in values else "epd_cache_dir": _local_cache_dir(
                fleet, host
            ),
            "epd_compile_cache_shared_dir": str(fleet.get(host, "epd_compile_cache_shared_dir") or ""),
        }
        for name, directory in dirs.items():
            if any(directory.rstrip("/") == tmp or directory.startswith(tmp + "/") for tmp in PRIVATE_TMP):
                yield (
                    f"{host}: {name} puts the compile cache in {directory}, which each engine's PrivateTmp hides "
                    f"and empties: set {name} to a lasting directory (the default is /var/cache/epd)"
                )


@rule(
    "strict-needs-a-shared-tier",
    "strict engines never compile: with no shared tier there is nothing to fetch and every engine fails",
)
def _strict_needs_shared(fleet: Fleet) -> Iterator[str]:
    for host in fleet.members(ENGINE)[:1]:
        strict = fleet.get(host, "epd_compile_cache_strict")
        if not isinstance(strict, bool):
            strict = str(strict).strip().lower() in TRUE_STRINGS
        backend = PROFILES.get(str(fleet.get(host, "epd_engine_backend")))
        cache = backend is None or backend.compile_cache  # none on vllm-cpu: backend_rules warns
        if strict and cache and not fleet.get(host, "epd_compile_cache_shared_dir"):
            yield (
                f"{host}: epd_compile_cache_strict is true but epd_compile_cache_shared_dir is empty: set the shared "
                "directory and run playbooks/precompile.yml, or set epd_compile_cache_strict false"
            )


# --------------------------------------------------------------------------- provisioning


@rule(
    "efa-installer-keeps-libfabric",
    "efa_installer.sh --minimal installs the kernel module and rdma-core only, "
    "not the libfabric NIXL's LIBFABRIC backend needs",
)
def _efa_minimal(fleet: Fleet) -> Iterator[str]:
    for host in fleet.members(ENGINE):
        options = fleet.get(host, "epd_provision_efa_installer_options") or []
        if isinstance(options, list) and {"-m", "--minimal"} & {str(o) for o in options}:
            yield (
                f"{host}: epd_provision_efa_installer_options is {options}: remove --minimal "
                "(epd_provision_efa_skip_kmod skips the kernel module)"
            )
            return


@rule(
    "engine-pins-in-the-release",
    "the release's table is the engine venv's whole requirement set; another package belongs in "
    "epd_provision_engine_extra_requirements, where it is explicit",
)
def _pins_in_release(fleet: Fleet) -> Iterator[str]:
    from .neuron_releases import RELEASES

    for host in fleet.members(ENGINE):
        pins = fleet.get(host, "epd_provision_engine_pins") or {}
        release = str(fleet.get(host, "epd_neuron_release"))
        if not isinstance(pins, Mapping) or release not in RELEASES:
            continue
        listed = RELEASES[release].engine_venv
        for name in pins:
            if name not in listed:
                fix = f"add it to epd_provision_engine_extra_requirements as {name}==VERSION"
                yield (
                    f"{host}: epd_provision_engine_pins sets {name}, which Neuron {release}'s engine venv does not "
                    f"list; {did_you_mean(str(name), list(listed), fix)}"
                )
        return


# The vLLM Neuron plugin's floor: "Neuron SDK version: Neuron 2.31 or later" (aws-neuron-sdk
# vllm-neuron/docs/getting-started/setup-guide.md, Prerequisites); Neuron 2.31.0's versions of the
# system packages (v2.31.0 release-notes/components/index.html: Neuron Driver 2.29.0.0, Runtime
# Library 2.33.10.0, Collectives 2.33.10.0, Developer Tools 2.31.11.0)
PLUGIN_FLOOR = {
    "epd_provision_neuron_driver_version": "2.29.0.0",
    "epd_provision_neuron_runtime_version": "2.33.10.0",
    "epd_provision_neuron_collectives_version": "2.33.10.0",
    "epd_provision_neuron_tools_version": "2.31.11.0",
}
# the same page's engine venv packages (Neuron Compiler 2.26.6360.0, Neuron Kernel Interface 0.5.0,
# torch-neuronx 2.9.0.2.15.32035), pinned through epd_provision_engine_pins
ENGINE_PIN_FLOOR = {"neuronx-cc": "2.26.6360.0", "nki": "0.5.0", "torch-neuronx": "2.9.0.2.15.32035"}


def _version(text: str) -> tuple[int, ...] | None:
    parts = str(text).strip().split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None  # the form check names others


@rule(
    "neuron-pins-at-the-plugin-floor",
    "the vLLM Neuron plugin needs Neuron 2.31 or later (its setup guide); an older driver, runtime, "
    "collectives or tools package is below what it was released with",
)
def _pins_at_floor(fleet: Fleet) -> Iterator[str]:
    for host in fleet.members(ENGINE):
        pins = fleet.get(host, "epd_provision_engine_pins")
        pins = pins if isinstance(pins, Mapping) else {}
        checked = [(name, fleet.get(host, name), floor) for name, floor in PLUGIN_FLOOR.items()]
        checked += [(f"epd_provision_engine_pins[{d!r}]", pins.get(d), floor) for d, floor in ENGINE_PIN_FLOOR.items()]
        for name, pin, floor in checked:
            version = _version(pin) if pin else None
            if version is not None and version < _version(floor):
                yield (
                    f"{host}: {name} is {pin}, below {floor} (Neuron 2.31's, the vLLM Neuron plugin's floor): "
                    f"pin {floor} or later, or leave it empty for the release's own"
                )


# --------------------------------------------------------------------------- one-run options and missing parts

# options of one run (-e), each an action: left in group_vars or host_vars, every run repeats it
ONE_RUN_ACTIONS = {
    "epd_rotate_engine_key": "every deploy makes a new engine key and restarts every engine",
    "epd_teardown_purge_cache": "every teardown also deletes the compile cache",
}


@rule(
    "one-run-actions-on-the-command-line",
    "an option of one run (scope run) is an action for that run: set in the inventory it repeats on every run",
    warning=True,
)
def _one_run_actions(fleet: Fleet) -> Iterator[str]:
    for name, harm in ONE_RUN_ACTIONS.items():
        hosts = [h for h in fleet.values if str(fleet.values[h].get(name, "")).strip().lower() in TRUE_STRINGS]
        if hosts:
            yield (
                f"{name} is true ({', '.join(hosts[:3])}{', ...' if len(hosts) > 3 else ''}): if the inventory sets "
                f"it, {harm}; give it on the command line for the one run (-e {name}=true) and remove it "
                "from group_vars and host_vars"
            )


@rule(
    "settings-for-parts-the-fleet-has",
    "a setting of a part the fleet does not have (a load balancer, a monitoring host, TLS) changes "
    "nothing; it was most likely meant for a part that is missing from the inventory",
    warning=True,
)
def _settings_for_missing_parts(fleet: Fleet) -> Iterator[str]:
    for group, part in ((LOADBALANCER, "load balancer"), (MONITORING, "monitoring host")):
        if fleet.members(group):
            continue
        names = sorted({n for v in fleet.values.values() for n in v if n in VARIABLES and VARIABLES[n].scope == group})
        if names:
            one = len(names) == 1
            yield (
                f"{', '.join(names)} {'is' if one else 'are'} set but the fleet has no {part} "
                f"(the group {group} is empty): add the host to {group}, or remove {'it' if one else 'them'}"
            )
    tls = any(v.get(n) for v in fleet.values.values() for n in ("epd_tls_certificate", "epd_tls_bundle"))
    for lb in fleet.members(LOADBALANCER):
        port = fleet.values[lb].get("epd_haproxy_http_redirect_port")
        if port is not None and not tls:
            yield (
                f"{lb}: epd_haproxy_http_redirect_port is {port}, but TLS is off (no epd_tls_certificate or "
                "epd_tls_bundle), so HAProxy opens no redirect listener: turn TLS on, or remove it"
            )
            return


# --------------------------------------------------------------------------- the plan


@rule(
    "draining-names-planned-engines",
    "the router marks draining only the ids it knows; a misspelt id leaves that engine in service",
)
def _draining_planned(fleet: Fleet) -> Iterator[str]:
    if fleet.plan is None:
        return
    ids = [e["engine_id"] for host_plan in fleet.plan.values() for e in host_plan["engines"]]
    for router in fleet.members(ROUTER):
        draining = fleet.get(router, "epd_router_draining") or []
        for engine_id in draining if isinstance(draining, list) else []:
            if engine_id not in ids:
                hint = did_you_mean(str(engine_id), ids, f"the planned ids are {', '.join(ids[:6])}")
                yield f"{router}: epd_router_draining names {engine_id}, which no engine of the plan has; {hint}"


# --------------------------------------------------------------------------- running them


def run(fleet: Fleet) -> tuple[list[str], list[str]]:
    """(problems, warnings) of every rule, each line once, with its reason. The security work's rules run
    beside these in checks.py: the front door's certificate (tls.tls_problems) and the firewall's
    (firewall.firewall_problems)."""
    problems: list[str] = []
    warnings: list[str] = []
    for item in RULES:
        for line in dict.fromkeys(item.check(fleet)):
            (warnings if item.warning else problems).append(f"{line} [{item.name}: {item.reason}]")
    return problems, warnings
