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

from .backends import PROFILES, BackendProfile, EngineProfile, backend_profile
from .checks import check_inventory, unresolved_problems
from .command import (
    ROLE_FLAGS,
    ROLES,
    SERVE_LINE,
    EngineCommand,
    additional_config,
    ec_transfer_config,
    engine_command,
    engine_env,
    serve_argv,
)
from .defaults import CHECK_DEFAULTS, GLOBAL_DEFAULTS, HOST_DEFAULTS
from .errors import EpdPlanError
from .fleet import plan_fleet, plan_table, router_endpoints, unreachable_engines, validate_plan
from .hosts import HostSpec, read_host
from .inventory import fleet_settings, plan_from_hostvars
from .managed import EFA_ENVIRONMENT, MANAGED_ENV, MANAGED_FLAGS, PREFIX_CACHING_OFF
from .net import probe_url
from .neuron_releases import RELEASES, engine_requirements, neuron_release, release_profile
from .operations import deployed_engines, engine_selection, rolling_queue, status_rows, status_table
from .placement import largest_fits, place, placement_order
from .rollout import rollout_batches, rollout_plan
from .router_config import router_config
from .settings import BACKEND_EXECUTABLES, Settings, read_settings
from .tenants import placeholder_api_keys_text, placeholder_tenants_text, tenants_file_text
from .timeouts import START_MARGIN_S, start_timeout_s
from .unit import engine_unit, exec_start, read_env_file
from .values import format_cores, plain

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
