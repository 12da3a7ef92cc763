"""epd_kit.plan: the trn2 topology planner and the one engine command model of epd-kit.

Stdlib only and relative imports only, so it imports inside any Ansible controller's Python and
the collection's filters load its bundled copy when the controller has no epd_kit
(plugins/filter/epd_kit.py, BUNDLED_NAME). Layout:

    variables     the declaration of every variable the kit reads (default, kind, bounds, scope, readers)
    defaults      the planner's defaults, from the declaration
    reference     docs/architecture.md's table of every variable, generated from the declaration
    values        checks for single inventory values
    neuron_releases the Neuron releases the kit installs: one table per release, a source per line
    managed       what the kit sets on every engine itself (flags, environment) and the checks of an
                  operator's additions (epd_extra_args, epd_engine_environment)
    settings      fleet-wide pool settings (Settings, read_settings)
    hosts         one engine host (HostSpec, read_host)
    placement     where each engine's core slice goes on a host
    command       THE `serve` command model: argv, environment, unit variables
    unit          the engine unit's ExecStart line and env file, from the command model
    fleet         the fleet plan, its checks, the router endpoints, the plan table
    inventory     the planner's input read from Ansible's hostvars
    checks        the inventory check every entry point runs first (typos, groups, duplicates, pools)
    validate      its checks of every declared value, dict key, scope, port per machine, rollout setting
    hints         "did you mean": the known name most likely meant
    router_config router.yaml from the plan
    router_shape  router.yaml's two shapes read as one list of models; what its processes read at start
    tenants       the router's tenants file from the inventory, checked by the router's rules
    tenants_format the tenants file's format and parser (the router loads the file with it)
    operations    what the ops playbooks compute (engine selection, rolling queue, status)
    rollout       batched rollouts: which engines restart together, the printed plan and estimate

docs/planner.md explains the rules; docs/architecture.md fixes the plan's schema.
"""

import importlib
import sys
import types
from typing import Any

# public name -> the submodule that defines it (imported with the first use of one of its names)
_EXPORTS = {
    "BACKEND_EXECUTABLES": "settings",
    "CHECK_DEFAULTS": "defaults",
    "EFA_ENVIRONMENT": "managed",
    "GLOBAL_DEFAULTS": "defaults",
    "HOST_DEFAULTS": "defaults",
    "MANAGED_ENV": "managed",
    "MANAGED_FLAGS": "managed",
    "PREFIX_CACHING_OFF": "managed",
    "PROFILES": "backends",
    "RELEASES": "neuron_releases",
    "ROLES": "command",
    "ROLE_FLAGS": "command",
    "SERVE_LINE": "command",
    "START_MARGIN_S": "timeouts",
    "BackendProfile": "backends",
    "EngineCommand": "command",
    "EngineProfile": "backends",
    "EpdPlanError": "errors",
    "HostSpec": "hosts",
    "Settings": "settings",
    "additional_config": "command",
    "backend_profile": "backends",
    "check_inventory": "checks",
    "deployed_engines": "operations",
    "ec_transfer_config": "command",
    "engine_command": "command",
    "engine_env": "command",
    "engine_requirements": "neuron_releases",
    "engine_selection": "operations",
    "engine_unit": "unit",
    "exec_start": "unit",
    "fleet_settings": "inventory",
    "format_cores": "values",
    "largest_fits": "placement",
    "neuron_release": "neuron_releases",
    "place": "placement",
    "placeholder_api_keys_text": "tenants",
    "placeholder_tenants_text": "tenants",
    "placement_order": "placement",
    "plain": "values",
    "plan_fleet": "fleet",
    "plan_from_hostvars": "inventory",
    "plan_table": "fleet",
    "probe_url": "net",
    "read_env_file": "unit",
    "read_host": "hosts",
    "read_settings": "settings",
    "release_profile": "neuron_releases",
    "rolling_queue": "operations",
    "rollout_batches": "rollout",
    "rollout_plan": "rollout",
    "router_config": "router_config",
    "router_endpoints": "fleet",
    "serve_argv": "command",
    "start_timeout_s": "timeouts",
    "status_rows": "operations",
    "status_table": "operations",
    "tenants_file_text": "tenants",
    "unreachable_engines": "fleet",
    "unresolved_problems": "checks",
    "validate_plan": "fleet",
}

__all__ = [
    "BACKEND_EXECUTABLES",
    "CHECK_DEFAULTS",
    "EFA_ENVIRONMENT",
    "GLOBAL_DEFAULTS",
    "HOST_DEFAULTS",
    "MANAGED_ENV",
    "MANAGED_FLAGS",
    "PREFIX_CACHING_OFF",
    "PROFILES",
    "RELEASES",
    "ROLES",
    "ROLE_FLAGS",
    "SERVE_LINE",
    "START_MARGIN_S",
    "BackendProfile",
    "EngineCommand",
    "EngineProfile",
    "EpdPlanError",
    "HostSpec",
    "Settings",
    "additional_config",
    "backend_profile",
    "check_inventory",
    "deployed_engines",
    "ec_transfer_config",
    "engine_command",
    "engine_env",
    "engine_requirements",
    "engine_selection",
    "engine_unit",
    "exec_start",
    "fleet_settings",
    "format_cores",
    "largest_fits",
    "neuron_release",
    "place",
    "placeholder_api_keys_text",
    "placeholder_tenants_text",
    "placement_order",
    "plain",
    "plan_fleet",
    "plan_from_hostvars",
    "plan_table",
    "probe_url",
    "read_env_file",
    "read_host",
    "read_settings",
    "release_profile",
    "rolling_queue",
    "rollout_batches",
    "rollout_plan",
    "router_config",
    "router_endpoints",
    "serve_argv",
    "start_timeout_s",
    "status_rows",
    "status_table",
    "tenants_file_text",
    "unreachable_engines",
    "unresolved_problems",
    "validate_plan",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule read as the package's attribute (plan.router_shape)
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def load_all() -> None:
    """Every exported name now, and so the submodules they need (what importing the package
    loaded before): for a process that forks workers which use the planner
    (plugins/callback/epd_preload.py), so that each inherits it instead of importing it."""
    for name in _EXPORTS:
        __getattr__(name)


class _Planner(types.ModuleType):
    """`router_config` names the submodule and the function it defines: the package's
    attribute stays the function (as when every submodule loaded with the package), though the
    import system sets it to the submodule when that loads after the package."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


_SHADOWED = frozenset(name for name, module in _EXPORTS.items() if name == module)
sys.modules[__name__].__class__ = _Planner
