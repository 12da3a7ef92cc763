"""systemctl queries shared by the kit's modules."""

from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule


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
