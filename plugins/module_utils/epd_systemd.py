"""systemctl queries shared by the kit's modules."""

from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule

# `systemctl is-active` states of a unit that runs or is on its way (systemd_service's view)
RUNNING = {"active", "activating", "reloading"}
# the `systemctl is-enabled` states it answers with exit code 0 for a unit asked alone
# (systemctl(1), systemd 252, "is-enabled" output table); every other state is not enabled
ENABLED = {"enabled", "enabled-runtime", "alias", "static", "indirect", "generated", "transient"}


def not_enabled(module: AnsibleModule, names: list[str]) -> list[str]:
    """The units that are not enabled, from one `systemctl is-enabled`: it prints a state per unit,
    and its exit code only says whether any unit is enabled. A unit it cannot find prints nothing
    (the lines no longer pair with the names), so then each unit is asked alone."""
    if not names:
        return []
    _rc, out, _err = module.run_command(["systemctl", "is-enabled", "--", *names], check_rc=False)
    states = out.splitlines()
    if len(states) == len(names):
        return [name for name, state in zip(names, states, strict=True) if state not in ENABLED]
    return [name for name in names if module.run_command(["systemctl", "is-enabled", "--", name])[0] != 0]


def active_states(module: AnsibleModule, units: list[str]) -> dict[str, str]:
    """Unit -> its `systemctl is-active` state (active, inactive, failed, activating, ...), in one
    call: systemctl prints one line per unit, in order, whatever its exit code (non-zero as soon
    as one unit is not active)."""
    if not units:
        return {}
    _rc, out, err = module.run_command(["systemctl", "is-active", "--", *units], check_rc=False)
    states = out.splitlines()
    if len(states) != len(units):
        module.fail_json(msg=f"systemctl is-active printed {len(states)} states for {len(units)} units: {err.strip()}")
    return dict(zip(units, states, strict=True))


def units_to_change(module: AnsibleModule, enabled: list[str], started: list[str]) -> tuple[list[str], list[str], dict]:
    """What epd_units would do: (the units of `enabled` that are not enabled, those of `started`
    that do not run, the `is-active` state of each of `started`), with one `is-enabled` and one
    `is-active` call. epd_host_state reports the same, so a role whose read finds nothing to
    enable or start skips its epd_units run."""
    to_enable = not_enabled(module, list(dict.fromkeys(enabled)))
    states = active_states(module, list(dict.fromkeys(started)))
    return to_enable, [name for name, state in states.items() if state not in RUNNING], states
