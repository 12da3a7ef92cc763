"""The fleet plan: every host's engines (slice, ports, id, command) and the fleet-wide checks.

The plan is plain data (docs/architecture.md "Planner output"), so Ansible can carry it as a
fact; everything later (units, env files, router config, status) is derived from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .command import ROLES, engine_command, engine_env
from .errors import EpdPlanError
from .hosts import HostSpec
from .models import check_model_hosts, fleet_models
from .net import is_loopback, url
from .placement import place_models
from .settings import MIN_PORT, Settings
from .timeouts import start_timeout_s
from .values import format_cores
from .variables import MAX_PORT


def plan_fleet(settings: Settings, hosts: Sequence[HostSpec]) -> dict[str, dict[str, Any]]:
    """Plan every host in inventory order. Identity is local to a host, so a change to one host's
    engines changes nothing planned for another: instances (`pd-0`) and ports are numbered per
    host; engine ids are `<prefix>-<role>-<n>` in a one-host fleet (the tutorial's) and
    `<prefix>-<label>-<role>-<n>` with several engine hosts (label: epd_engine_id_label, by
    default the inventory name)."""
    names = [h.name for h in hosts]
    if not hosts:
        raise EpdPlanError("no engine hosts: add hosts to the epd_engines group")
    if len(set(names)) != len(names):
        raise EpdPlanError(
            f"host listed twice in the engine hosts: {sorted(n for n in names if names.count(n) > 1)[0]}"
        )
    labels: dict[str, str] = {}
    for host in hosts:
        label = host.id_label or host.name
        if label in labels:
            raise EpdPlanError(
                f"{labels[label]} and {host.name} both label their engine ids {label!r}: engine ids must be "
                "unique fleet-wide, so give each host its own epd_engine_id_label"
            )
        labels[label] = host.name
    host_part = {host.name: "" if len(hosts) == 1 else f"{host.id_label or host.name}-" for host in hosts}
    check_model_hosts(settings.models, names)
    plan: dict[str, dict[str, Any]] = {}
    for host in hosts:
        starts = place_models(host, settings)
        engines = []
        for spec in fleet_models(settings):
            if spec.key in starts:
                engines += _engines(spec.settings, host, host_part[host.name], starts[spec.key], spec.key)
        engines.sort(key=lambda e: e["cores"][0])
        for position, engine in enumerate(engines):
            engine["start_delay_s"] = position * settings.start_stagger_s
        plan[host.name] = {
            "host": host.name,
            "bind_address": host.bind_address,
            "core_count": host.core_count,
            "usable_cores": host.usable_cores,
            "excluded_cores": sorted(host.excluded_cores),
            "faulted_cores": sorted(c for c in host.faulted_cores if c < host.core_count),
            "engines": engines,
            "start_timeout_s": start_timeout_s(settings, host.name, engines),
        }
    validate_plan(plan, settings)
    return plan


def _engines(
    settings: Settings, host: HostSpec, host_part: str, starts: Mapping[str, Sequence[int]], model: str | None = None
) -> list[dict[str, Any]]:
    """One model's engines on one host, named by its key (models.fleet_models): models[0]'s (key
    None) without a prefix (pd-0, epd-pd-0), an epd_models entry's with its name (text-pd-0,
    epd-text-pd-0) and a `model` key."""
    engines = []
    name_part = f"{model}-" if model else ""
    for role in ROLES:
        tp = settings.tp(role)
        for local, start in enumerate(starts[role]):
            engine_id = f"{settings.engine_id_prefix}-{host_part}{name_part}{role}-{local}"
            port = (settings.ve_port_base if role == "ve" else settings.pd_port_base) + local
            side = settings.side_channel_port_base + local * tp if role == "ve" else None
            cores = list(range(start, start + tp))
            command = engine_command(settings, role, engine_id, host.bind_address, port, side)
            engine = {
                "instance": f"{name_part}{role}-{local}",
                "role": role,
                "engine_id": engine_id,
                "tp": tp,
                "dp": settings.ve_dp if role == "ve" else 1,
                "cores": cores,
                "host": host.bind_address,
                "port": port,
                "url": url(host.bind_address, port),
                "side_channel_port": side,
                "side_channel_ports": list(range(side, side + tp)) if side is not None else [],
                "start_delay_s": 0,
                "argv": command.argv(settings.executable),
                "unit_variables": command.unit_variables(),
                "env": engine_env(settings, cores, engine_id, (host.bind_address, side) if side is not None else None),
            }
            if model:
                engine["model"] = model
            engines.append(engine)
    return engines


def validate_plan(plan: Mapping[str, Mapping[str, Any]], settings: Settings) -> None:
    """Fleet-wide invariants: unique engine ids and endpoints, per-host ports and cores."""
    ids: dict[str, str] = {}
    urls: dict[str, str] = {}
    hosts_with_engines = [h for h, p in plan.items() if p["engines"]]
    for host, host_plan in plan.items():
        ports: dict[int, str] = {settings.router_port: "the router (epd_router_port)"}
        cores: dict[int, str] = {}
        for engine in host_plan["engines"]:
            eid = engine["engine_id"]
            if eid in ids:
                raise EpdPlanError(
                    f"duplicate engine id {eid} on {ids[eid]} and {host}: "
                    "engine ids key NIXL handshakes and must be unique fleet-wide"
                )
            ids[eid] = host
            if len(engine["cores"]) != engine["tp"] or engine["cores"][0] % engine["tp"]:
                raise EpdPlanError(
                    f"{host}: {eid} cores {format_cores(engine['cores'])} "
                    f"do not form an aligned tp={engine['tp']} slice"
                )
            for core in engine["cores"]:
                if core in cores:
                    raise EpdPlanError(f"{host}: core {core} assigned to both {cores[core]} and {eid}")
                cores[core] = eid
            uses = [(engine["port"], f"{eid} (HTTP)")]
            uses += [(p, f"{eid} (side channel rank {r})") for r, p in enumerate(engine["side_channel_ports"])]
            for port, what in uses:
                if not MIN_PORT <= port <= MAX_PORT:
                    raise EpdPlanError(
                        f"{host}: port {port} of {what} is outside {MIN_PORT}-{MAX_PORT}; lower the port bases"
                    )
                if port in ports:
                    raise EpdPlanError(
                        f"{host}: port {port} is used by both {ports[port]} and {what}; move "
                        "epd_ve_port_base, epd_pd_port_base, epd_side_channel_port_base or "
                        "epd_router_port so the ranges do not overlap"
                    )
                ports[port] = what
    for host, host_plan in plan.items():
        for engine in host_plan["engines"]:
            if engine["url"] in urls:
                raise EpdPlanError(
                    f"{host} and {urls[engine['url']]} both serve {engine['url']}: give each host its "
                    "own epd_bind_address (its private address)"
                )
            urls[engine["url"]] = host
    # the backend's profile says whether its engines may span hosts (vllm-cpu: the shared directory
    # is one host's; the kit's NIXL connector reads across hosts)
    if not settings.profile.spans_hosts and len(hosts_with_engines) > 1:
        raise EpdPlanError(
            f"epd_engine_backend vllm-cpu runs engines on one host with epd_vllm_cpu_ec_transport shared-dir, "
            f"and this fleet has them on {', '.join(hosts_with_engines)}: its encoder cache is vLLM's "
            "shared-storage connector, one directory (epd_vllm_cpu_ec_dir) that the VEs write and the PDs "
            "read; set epd_vllm_cpu_ec_transport nixl, put every engine on one host or use epd_engine_backend vllm"
        )
    if len(hosts_with_engines) > 1:
        for host in hosts_with_engines:
            if is_loopback(plan[host]["bind_address"]):
                raise EpdPlanError(
                    f"{host} binds its engines to {plan[host]['bind_address']} in a multi-host fleet: "
                    "the router and PD engines on other hosts cannot reach it; set epd_bind_address "
                    "to the host's private address"
                )


def router_endpoints(
    plan: Mapping[str, Mapping[str, Any]], draining: Sequence[str] = (), model: str | None = None
) -> dict[str, list[dict[str, str]]]:
    """The router's endpoint lists of one model (by its key: None for models[0]), host by host in inventory
    order and by number on each host; ids in `draining` are marked so."""
    out: dict[str, list[dict[str, Any]]] = {role: [] for role in ROLES}
    for host_plan in plan.values():
        for engine in sorted(host_plan["engines"], key=lambda e: int(e["instance"].rsplit("-", 1)[1])):
            if engine.get("model") != model:
                continue
            state = "draining" if engine["engine_id"] in draining else "active"
            out[engine["role"]].append({"id": engine["engine_id"], "url": engine["url"], "state": state})
    return out


def unreachable_engines(plan: Mapping[str, Mapping[str, Any]], router_hosts: Sequence[str]) -> list[str]:
    """Engines a router on another host cannot reach: they listen on a loopback address."""
    problems = []
    for router in router_hosts:
        for name, host_plan in plan.items():
            if name != router and host_plan["engines"] and is_loopback(host_plan["bind_address"]):
                problems.append(
                    f"router host {router} cannot reach the engines of {name} on {host_plan['bind_address']}"
                )
    return problems


def plan_table(plan: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per engine: host, instance, role, cores, ports, engine id (for plan.yml)."""
    header = ("host", "engine", "role", "cores", "port", "side channel", "engine id", "start +s")
    rows = [header]
    for host, host_plan in plan.items():
        if not host_plan["engines"]:
            rows.append((host, "-", "-", "-", "-", "-", "-", "-"))
        for e in host_plan["engines"]:
            side = e["side_channel_ports"]
            rows.append(
                (
                    host,
                    e["instance"],
                    f"{e['role']} tp{e['tp']}",
                    format_cores(e["cores"]),
                    str(e["port"]),
                    f"{side[0]}-{side[-1]}" if side else "-",
                    e["engine_id"],
                    str(e["start_delay_s"]),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for host, host_plan in plan.items():
        lines.append(
            f"{host}: {host_plan['usable_cores']}/{host_plan['core_count']} usable cores, excluded "
            f"{format_cores(host_plan['excluded_cores'])}, faulted {format_cores(host_plan['faulted_cores'])}"
        )
    return lines
