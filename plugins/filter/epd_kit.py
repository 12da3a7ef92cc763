"""The epd-kit Ansible filters: thin shims over epd_kit.plan (the planner and the engine command model).

epd_kit.plan comes from the controller's Python when the kit is installed there; otherwise the
collection's own copy of the package (router/epd_kit) is loaded under a private name, so the
collection works on any controller: the planner is stdlib only, and where the controller's Python
has pydantic (meta/ee-requirements.txt) the inventory check applies the router's own settings
models from the same copy (plan/router_check.py). A planner error fails the task with the
planner's message.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import sys
from functools import cache, wraps
from pathlib import Path
from types import ModuleType

import yaml
from ansible.errors import AnsibleFilterError

COLLECTION = Path(__file__).resolve().parents[2]
BUNDLED_PACKAGE = COLLECTION / "router" / "epd_kit"
# The collection's copy of epd_kit under a name no installed package has: an installed (or
# shadowing) epd_kit is never replaced. Its modules import each other relatively, so the planner
# reaches router_yaml as its parent's module (plan/router_check.py) under either name.
BUNDLED_NAME = "epd_kit_bundled"
# An optional variable a playbook, task or template reads: `epd_x | default(...)`, `epd_x is defined`.
OPTIONAL_READ = re.compile(r"\b(epd_\w+)\s*(?:\|\s*default\(|is (?:not )?defined)")


def _load_plan() -> ModuleType:
    try:
        return importlib.import_module("epd_kit.plan")
    except ImportError:
        pass
    if BUNDLED_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            BUNDLED_NAME, BUNDLED_PACKAGE / "__init__.py", submodule_search_locations=[str(BUNDLED_PACKAGE)]
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"epd_kit.plan is neither installed nor bundled at {BUNDLED_PACKAGE / 'plan'}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[BUNDLED_NAME] = module  # registered first: relative imports and dataclasses look it up
        spec.loader.exec_module(module)  # an empty __init__: the router's runtime is never imported
    return importlib.import_module(f"{BUNDLED_NAME}.plan")


plan = _load_plan()


def _filter(function):
    """Fail the task with the planner's message instead of a traceback."""

    @wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except plan.EpdPlanError as error:
            raise AnsibleFilterError(f"epd planner: {error}") from None

    return wrapper


def kit_path(relative: str) -> str:
    """A path inside the collection (the repository when run from it), e.g. its templates/."""
    return str(COLLECTION / relative)


def declared_default(name: str):
    """The default of a variable as the kit declares it (epd_kit.plan.variables): a task that reads
    an optional variable writes `epd_x | default('epd_x' | epd.kit.epd_declared_default)`, so the
    value lives in the declaration only."""
    try:
        return plan.variables.VARIABLES[name].default
    except KeyError:
        raise plan.EpdPlanError(f"{name} is not a declared variable (router/epd_kit/plan/variables.py)") from None


@cache
def known_variables() -> frozenset[str]:
    """Every epd_* name the kit reads: the options of every role entry point (the planner's
    inventory model is epd_common's "plan" spec), the playbooks' play variables and the
    optional variables read with a default (e.g. epd_router_api_key)."""
    names: set[str] = set()
    for spec_file in sorted(COLLECTION.glob("roles/*/meta/argument_specs.yml")):
        for entry in yaml.safe_load(spec_file.read_text())["argument_specs"].values():
            names.update(entry.get("options") or {})
    for book in sorted(COLLECTION.glob("playbooks/*.yml")):
        for play in yaml.safe_load(book.read_text()) or []:
            names.update(play.get("vars") or {})
    for pattern in ("playbooks/**/*.yml", "roles/*/tasks/*.yml", "templates/*.j2"):
        for source in sorted(COLLECTION.glob(pattern)):
            names.update(OPTIONAL_READ.findall(source.read_text()))
    return frozenset(name for name in names if name.startswith("epd_"))


def checked_plan(hostvars, groups, faulted=None, check_variables=True, plan_fleet=True):
    """The inventory check and the plan: {problems, warnings, plan, settings} (epd_common's plan entry point)."""
    known = known_variables() if check_variables else None
    return plan.check_inventory(hostvars, groups, plan.plain(faulted or {}), known, plan_fleet=plan_fleet)


def unresolved_addresses(hostvars, groups):
    """Kit hosts' addresses taken from facts, which the controller check cannot resolve (epd_common's addresses)."""
    return plan.unresolved_problems(hostvars, groups)


def trace_store(hostvars, groups):
    """The fleet's trace store (plan/trace_store.py): {host, address, port, grpc_port, url,
    traces_endpoint, own_table}, or {} without one (epd_observability). own_table: its host is no
    other kit host, so the observability role loads the kit's table there (plan/firewall.py
    dedicated_store_host)."""
    store = plan.trace_store.trace_store(hostvars, groups)  # the submodule (checks.py imports it)
    if store is None:
        return {}
    own_table = importlib.import_module(f"{plan.__name__}.firewall").dedicated_store_host(hostvars, groups)
    return dataclasses.asdict(store) | {
        "url": store.url,
        "traces_endpoint": store.traces_endpoint,
        "own_table": own_table == store.host,
    }


def settings(hostvars, hosts):
    return plan.fleet_settings(hostvars, hosts).as_dict()


def engine_profile(backend):
    """The engine backend profile of an epd_engine_backend value (plan/backends.py): epd_common's
    epd_common_engine_profile, whose fields the roles read instead of the backend's name."""
    return plan.backend_profile(backend).as_dict()


def router_config(fleet_plan, fleet_settings, **options):
    options = {key: plan.plain(value) for key, value in options.items()}
    return plan.router_config(fleet_plan, plan.read_settings(fleet_settings), **options)


def engine_render_files(engines, units, unit_environment, host, templates_dir, env_dir):
    """render.yml's files of each engine (epd.kit.epd_render_files specs): its env file and a JSON
    record of the exact argv and environment its unit runs."""
    files = []
    for engine in engines:
        instance = engine["instance"]
        unit = units[instance]
        files.append(
            {
                "dest": f"{env_dir}/{instance}.env",
                "template": f"{templates_dir}/epd-engine.env.j2",
                "vars": {"engine": engine, "epd_engine_unit": unit},
            }
        )
        record = {
            "host": host,
            "unit": f"epd-engine@{instance}.service",
            "engine_id": engine["engine_id"],
            "role": engine["role"],
            "cores": engine["cores"],
            "argv": unit["argv"],
            "environment": {**unit_environment, **unit["env_file"]},
        }
        files.append({"dest": f"engines/{instance}.json", "json": record})
    return files


def status_table(hostvars, engine_hosts, router_hosts):
    hosts = list(engine_hosts) + list(router_hosts)
    rows = {host: hostvars[host]["epd_status_rows"] for host in hosts if "epd_status_rows" in hostvars[host]}
    return plan.status_table(rows, engine_hosts, router_hosts)


class FilterModule:
    """The planner, the engine unit, the router config, the ops helpers and the collection's own paths."""

    def filters(self):
        return {
            name: _filter(function)
            for name, function in {
                "epd_checked_plan": checked_plan,
                "epd_trace_store": trace_store,
                "epd_traces_summary": plan.trace_store.traces_summary,
                "epd_unresolved_addresses": unresolved_addresses,
                "epd_plan": plan.plan_from_hostvars,
                "epd_settings": settings,
                "epd_engine_profile": engine_profile,
                "epd_plan_table": plan.plan_table,
                "epd_router_endpoints": plan.router_endpoints,
                "epd_unreachable_engines": plan.unreachable_engines,
                "epd_engine_unit": plan.engine_unit,
                "epd_engine_exec_start": plan.exec_start,
                "epd_router_config": router_config,
                "epd_router_restart_view": plan.router_shape.restart_view,
                "epd_router_tenants_text": plan.tenants_file_text,
                "epd_router_tenants_placeholder": plan.placeholder_tenants_text,
                "epd_router_api_keys_placeholder": plan.placeholder_api_keys_text,
                "epd_probe_url": plan.probe_url,
                "epd_engine_selection": plan.engine_selection,
                "epd_deployed_engines": plan.deployed_engines,
                "epd_rolling_queue": plan.rolling_queue,
                "epd_rollout_plan": plan.rollout_plan,
                "epd_rollout_changes": plan.rollout.changed_engines,
                "epd_rollout_retiring": plan.rollout.retiring_endpoints,
                "epd_precompile_jobs": plan.rollout.precompile_jobs,
                "epd_status_rows": plan.status_rows,
                "epd_status_table": status_table,
                "epd_engine_render_files": engine_render_files,
                "epd_env_file": plan.read_env_file,
                "epd_kit_path": kit_path,
                "epd_neuron_release": plan.release_profile,
                "epd_engine_requirements": plan.engine_requirements,
                "epd_declared_default": declared_default,
            }.items()
        }
