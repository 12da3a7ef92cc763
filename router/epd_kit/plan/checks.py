"""The inventory check: the one validation path of plan.yml, render.yml and deploy's preflight.

It runs on the controller before any host is touched and reports what the planner alone cannot
see: missing groups, unknown `epd_*` variables (typos) on any host, every declared variable's
value, dict keys and scope (validate.py), one machine under two inventory names or aliases,
names too long for a file name, a pool with no engines, engines a router cannot reach, ports
shared on one machine, rollout settings the pools cannot meet. Then it plans, so every planner
error comes through the same path. Each problem is one short line naming the host, the variable and
the fix; docs/planner.md "Bad inventories and their messages" lists them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from . import alike, backend_rules  # noqa: F401  (their rules register into rules.RULES on import)
from .defaults import CHECK_DEFAULTS
from .errors import EpdPlanError
from .firewall import firewall_problems
from .fleet import unreachable_engines
from .hints import did_you_mean
from .inventory import fleet_settings, plan_from_hostvars
from .models import first_name_problems
from .router_check import available as router_models_available
from .router_check import install_command, planned_value_problems, unavailable_reason
from .rules import Fleet
from .rules import run as run_rules
from .tenants import key_strength_problems, tenant_problems
from .tls import tls_problems
from .trace_store import store_problems, with_default_endpoint
from .validate import (
    BOOL_STRINGS,
    PRECOMPILE,
    explicit,
    hosts_text,
    machine_of,
    name_problems,
    port_problems,
    rollout_problems,
    scope_problems,
    value_problems,
)
from .values import describe, plain, unresolved
from .variables import GROUP_SCOPES as KIT_GROUPS
from .variables import VARIABLES

ENGINE_GROUP, ROUTER_GROUP = "epd_engines", "epd_router"


def group_problems(groups: Mapping[str, Any]) -> list[str]:
    problems = []
    if not groups.get(ENGINE_GROUP):
        problems.append(f"no engine hosts: add hosts to the {ENGINE_GROUP} group, each with epd_num_ve / epd_num_pd")
    if not groups.get(ROUTER_GROUP):
        problems.append(
            f"no router host: add a host to the {ROUTER_GROUP} group (on one machine, the engine host itself)"
        )
    return problems


def unknown_variable_problems(
    hostvars: Mapping[str, Any], hosts: Iterable[str], known_variables: Collection[str]
) -> list[str]:
    """Every `epd_*` name the kit does not read, once, with the hosts that set it and the nearest known name."""
    where: dict[str, list[str]] = {}
    for host in hosts:
        for name in hostvars[host]:
            if str(name).startswith("epd_") and name not in known_variables:
                where.setdefault(str(name), []).append(host)
    problems = []
    for name, names in sorted(where.items()):
        fix = did_you_mean(name, known_variables, "remove it (docs/architecture.md lists the inventory variables)")
        problems.append(f"{hosts_text(names)}: unknown variable {name}; {fix}")
    return problems


def machine_problems(hostvars: Mapping[str, Any], hosts: Iterable[str]) -> list[str]:
    """One machine under two inventory names (or two aliases: letter case, loopback names) plans the
    same cores and ports twice."""
    names_of: dict[tuple[str, str], list[str]] = {}
    for host in hosts:
        names_of.setdefault(machine_of(host, hostvars[host]), []).append(host)
    return [
        f"{' and '.join(names)} are the same machine "
        f"({'both loopback' if address == 'loopback' else f'ansible_host {address}'}): list it once under one "
        "name and put that name in every group it belongs to"
        for (address, _), names in names_of.items()
        if len(names) > 1
    ]


def text_only(hostvars: Mapping[str, Any], engine_hosts: list[str]) -> bool:
    """epd_text_only as Ansible's `| bool` reads it (an INI inventory passes `true` as text)."""
    value = plain(hostvars[engine_hosts[0]].get("epd_text_only", CHECK_DEFAULTS["epd_text_only"]))
    if isinstance(value, str) and value.strip().lower() in BOOL_STRINGS:
        return value.strip().lower() in {"true", "yes", "on", "1", "y", "t"}
    if not isinstance(value, bool):
        raise EpdPlanError(f"epd_text_only must be true or false, got {describe(value)}")
    return value


# addresses the plan needs before any host is contacted: a value taken from facts cannot resolve yet
ADDRESS_VARIABLES = ("epd_bind_address", "epd_router_listen_host", "epd_haproxy_bind_address")


def kit_hosts(hostvars: Mapping[str, Any], groups: Mapping[str, Any]) -> list[str]:
    """Every host of the kit's groups that the inventory has, engine and router hosts first."""
    names = [str(h) for group in (ENGINE_GROUP, ROUTER_GROUP, *KIT_GROUPS, PRECOMPILE) for h in groups.get(group) or []]
    return [host for host in dict.fromkeys(names) if host in hostvars]


def unresolved_problems(hostvars: Mapping[str, Any], groups: Mapping[str, Any]) -> list[str]:
    """An address set from facts (e.g. "{{ ansible_default_ipv4.address }}"): the check and the plan run
    on the controller before facts are gathered, so the value is explained instead of Ansible's
    undefined-variable error."""
    problems = []
    for host in kit_hosts(hostvars, groups):
        for name in ADDRESS_VARIABLES:
            if name not in hostvars[host]:
                continue
            try:
                # ansible-core 2.19 hands an unresolvable value on as a marker (jinja2.Undefined); older ones raise
                resolved = not unresolved(plain(hostvars[host][name]))
            except Exception:  # Ansible's undefined-variable error: a fact, not known yet
                resolved = False
            if not resolved:
                problems.append(
                    f"{host}: {name} cannot be resolved before any host is contacted: the inventory check and the "
                    "plan run on the controller before facts (ansible_default_ipv4, ...) are gathered, and every "
                    f"engine's URL is built from it; write {host}'s private address itself (e.g. {name}: 10.0.0.5), "
                    "or take it from the inventory (ansible_host) rather than from facts"
                )
    return problems


def pool_problems(plan: Mapping[str, Mapping[str, Any]], is_text_only: bool) -> list[str]:
    count = {"ve": 0, "pd": 0}
    ves: dict[str, int] = {}  # host -> its VEs of models[0] (epd_model)
    for host, host_plan in plan.items():
        for engine in host_plan["engines"]:
            if "model" not in engine:  # models[0]'s (an epd_models entry's pools: models.py)
                count[engine["role"]] += 1
                if engine["role"] == "ve":
                    ves[host] = ves.get(host, 0) + 1
    problems = []
    if not count["pd"]:
        problems.append(
            "no PD engine in the fleet: set epd_num_pd on at least one engine host (PDs answer every request)"
        )
    if is_text_only and count["ve"]:
        where = ", ".join(f"{host}: epd_num_ve {n}" for host, n in list(ves.items())[:4])
        problems.append(
            f"epd_text_only is true but {count['ve']} VE engine(s) are planned ({where}): set epd_num_ve to 0 "
            f"where it is set for {hosts_text(list(ves))} (a host's own entry overrides group_vars), or drop "
            "epd_text_only"
        )
    if not is_text_only and not count["ve"]:
        problems.append(
            "no VE engine in the fleet: set epd_num_ve on at least one engine host, or set "
            "epd_text_only: true in group_vars/all for a fleet that serves text only"
        )
    return problems


def check_inventory(
    hostvars: Mapping[str, Any],
    groups: Mapping[str, Any],
    faulted: Mapping[str, Any] | None = None,
    known_variables: Collection[str] | None = None,
    *,
    plan_fleet: bool = True,
) -> dict[str, Any]:
    """{"problems": [...], "warnings": [...], "plan": ..., "settings": ...}; plan and settings are None
    when there are problems (or when not planning). Warnings never fail the check.

    known_variables: every `epd_*` name the kit reads; None skips the unknown-variable check, the value
    checks and the cross-setting rules (a re-plan after facts were gathered, when hostvars also hold
    the kit's own facts). plan_fleet=False checks the variables only, without groups or a plan
    (provision.yml and teardown.yml need no model and no router).
    """
    engines = [str(h) for h in groups.get(ENGINE_GROUP) or []]
    routers = [str(h) for h in groups.get(ROUTER_GROUP) or []]
    everyone = list(dict.fromkeys(engines + routers))
    # every host of the kit's groups: monitoring and load-balancer hosts' variables are the kit's too
    inventory_hosts = kit_hosts(hostvars, groups)
    problems = group_problems(groups) if plan_fleet else []
    problems += name_problems(inventory_hosts) + machine_problems(hostvars, everyone)
    values = {host: explicit(hostvars, host) for host in inventory_hosts}
    warnings: list[str] = []
    if known_variables is not None:
        known = {*known_variables, *VARIABLES}
        problems += unknown_variable_problems(hostvars, inventory_hosts, known)
        problems += unresolved_problems(hostvars, groups)
        problems += value_problems(values) + scope_problems(values, groups)
        problems += tls_problems(values, groups)  # the front door's certificate files (plan/tls.py)
        # the tenants file the router role renders, by the router's own rules (plan/tenants.py)
        problems += list(dict.fromkeys(p for host in routers for p in tenant_problems(values.get(host, {}))))
        problems += list(dict.fromkeys(p for host in everyone for p in key_strength_problems(values.get(host, {}))))
        # router.yaml values the kit writes from one variable each (the traces URL, ...), by the router's models
        problems += list(dict.fromkeys(p for host in routers for p in planned_value_problems(values.get(host, {}))))
        if not router_models_available():
            warnings.append(
                "the router's settings (epd_router_<section>, epd_router_extra_config) were checked by kind only: "
                f"the controller's Python cannot load the router's settings models ({unavailable_reason()}); "
                f"for epd-router check-config's full rules run: {install_command()}"
            )
    if problems:
        return {"problems": problems, "warnings": warnings, "plan": None, "settings": None}
    fleet = Fleet(values, groups, {host: machine_of(host, hostvars[host]) for host in inventory_hosts})
    if not plan_fleet:
        rule_problems, rule_warnings = run_rules(fleet) if known_variables is not None else ([], [])
        return {"problems": rule_problems, "warnings": warnings + rule_warnings, "plan": None, "settings": None}
    try:
        traced = with_default_endpoint(hostvars, groups, engines)  # the trace store's URL when none is set
        settings = fleet_settings(traced, engines)
        plan = plan_from_hostvars(traced, engines, faulted)
        is_text_only = text_only(hostvars, engines)
        problems = pool_problems(plan, is_text_only)
    except EpdPlanError as error:
        rule_problems, rule_warnings = run_rules(fleet) if known_variables is not None else ([], [])
        problems = [str(error), *rule_problems]
        return {"problems": problems, "warnings": warnings + rule_warnings, "plan": None, "settings": None}
    problems += [
        f"{problem}: set epd_bind_address of that engine host to its private address, or put the router on it"
        for problem in unreachable_engines(plan, routers)
    ]
    # models[0]'s served name (an epd_models entry's: models.py read_models)
    served = {host: values.get(host, {}).get("epd_router_served_model_name") for host in routers}
    problems += first_name_problems(served, settings.models)
    problems += port_problems(plan, settings.router_port, hostvars, groups)
    problems += firewall_problems(plan, hostvars, groups)
    problems += store_problems(hostvars, groups)
    models = [spec.as_dict() for spec in settings.models]
    problems += rollout_problems(plan, values[routers[0]] if routers else {}, models)
    if known_variables is not None:
        rule_problems, rule_warnings = run_rules(Fleet(fleet.values, groups, fleet.machines, plan))
        problems += rule_problems
        warnings += rule_warnings
    if problems:
        return {"problems": problems, "warnings": warnings, "plan": None, "settings": None}
    # epd_text_only as read here: the router's config says it (router_config's text_only)
    return {
        "problems": [],
        "warnings": warnings,
        "plan": plan,
        "settings": {**settings.as_dict(), "epd_text_only": is_text_only},
    }
