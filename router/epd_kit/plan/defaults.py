"""The defaults of the inventory variables the planner reads, taken from the declaration (variables.py).

The roles' argument specs, the inventory table of docs/architecture.md and the router's
plan-derived limits are checked against the declaration (tests/unit/plan/test_variables.py);
`epd_settings` exposes these to playbooks.
"""

from __future__ import annotations

from typing import Any

from .variables import ENGINE, FLEET, HOST, defaults_of

PLAN_SPEC, CHECK_SPEC = "epd_common.plan", "epd_preflight.controller"

# Fleet-wide pool settings (group_vars/all); each must agree on every host.
# epd_start_timeout_s None: derived per host, compile budget + the host's last start delay + a margin (timeouts.py)
GLOBAL_DEFAULTS: dict[str, Any] = defaults_of(PLAN_SPEC, (FLEET,))

# Per engine host (host_vars or the inventory's host line).
# epd_engine_id_label None: the inventory name (the host's part of its engine ids in a fleet of several engine hosts)
HOST_DEFAULTS: dict[str, Any] = defaults_of(PLAN_SPEC, (ENGINE, HOST))

# Read only by the inventory check (checks.py): not part of the plan, so not in the inventory table.
# epd_text_only true: a fleet without VE engines is intended (text-only requests)
CHECK_DEFAULTS: dict[str, Any] = defaults_of(CHECK_SPEC)
