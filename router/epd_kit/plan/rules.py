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

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
    "a stage's cap above the whole request's bound never applies: timeouts.total_s ends the request first",
    warning=True,
)
def _stage_within_total(fleet: Fleet) -> Iterator[str]:
    for key in ("ve_s", "pd_s"):
        for router, stage, total in _above(fleet, "timeouts", key, "total_s", strict=True):
            yield f"{router}: {stage} is above {total}: lower {key} to at most total_s, or raise total_s"


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
    "it longer reuses a closed connection and fails that request (router/config.py Listen)",
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
            name = "epd_router_listen_host" if "epd_router_listen_host" in fleet.values[router] else "epd_bind_address"
            yield (
                f"{router}: the router listens on {listen} ({name}), which the load balancer {far[0]} on another "
                f"machine cannot reach: set epd_bind_address of {router} to its private address"
            )


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


@rule(
    "strict-needs-a-shared-tier",
    "strict engines never compile: with no shared tier there is nothing to fetch and every engine fails",
)
def _strict_needs_shared(fleet: Fleet) -> Iterator[str]:
    for host in fleet.members(ENGINE)[:1]:
        strict = fleet.get(host, "epd_compile_cache_strict")
        if not isinstance(strict, bool):
            strict = str(strict).strip().lower() in TRUE_STRINGS
        if strict and not fleet.get(host, "epd_compile_cache_shared_dir"):
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
