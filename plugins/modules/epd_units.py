#!/usr/bin/python
"""Ansible module: enable and start several systemd units in one module run."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: epd_units
short_description: Enable and start several systemd units in one module run
description:
  - Reads the state of every listed unit with one C(systemctl is-enabled) and one
    C(systemctl is-active), then enables the units that are not enabled with one
    C(systemctl enable) and starts those that do not run with one C(systemctl start).
    A role that enables its targets and starts N engines does so in one start of the host's
    Python instead of N + 2 M(ansible.builtin.systemd_service) runs, each about 0.3 s of CPU on
    the host (docs/sandbox.md).
  - Idempotent in the same sense as M(ansible.builtin.systemd_service) C(enabled=true) and
    C(state=started) - a unit counts as enabled when C(systemctl is-enabled) succeeds for it
    (enabled, static, alias, indirect, generated, ...) and as running when it is active,
    activating or reloading.
  - A unit to start that systemd reports C(failed) is reset first, with one C(systemctl reset-failed)
    call. After a crash loop systemd refuses to start it again (Start request repeated too quickly,
    its StartLimitBurst), so a deploy that fixes what crashed it could not start it otherwise.
  - Restarts, stops and reloads are not its job; those stay with
    M(ansible.builtin.systemd_service), where throttle and handlers order them.
  - Supports check mode (reports what it would enable and start).
options:
  enabled:
    description: Units to enable (full names, C(epd.target), C(epd-engine@pd-0.service)).
    type: list
    elements: str
    default: []
  started:
    description: Units to start when they are neither active nor activating, after the enables, in this order.
    type: list
    elements: str
    default: []
  no_block:
    description: Queue the start jobs and return without waiting for them (C(systemctl start --no-block)).
    type: bool
    default: false
author: epd-kit
"""

EXAMPLES = r"""
- name: Enable the targets, enable and start the engines (they start in parallel)
  epd.kit.epd_units:
    enabled: [epd.target, epd-engines.target, epd-engine@pd-0.service, epd-engine@pd-1.service]
    started: [epd-engine@pd-0.service, epd-engine@pd-1.service]
    no_block: true
"""

RETURN = r"""
reset:
  description: The units this run reset from C(failed) before starting them.
  type: list
  elements: str
  returned: always
enabled:
  description: The units this run enabled.
  type: list
  elements: str
  returned: always
started:
  description: The units this run started (or queued a start job for, with no_block).
  type: list
  elements: str
  returned: always
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.epd.kit.plugins.module_utils.epd_systemd import units_to_change


def _run(module: AnsibleModule, argv: list[str]) -> None:
    rc, out, err = module.run_command(argv, check_rc=False)
    if rc != 0:
        module.fail_json(msg=f"{' '.join(argv)} failed (rc {rc}): {(err or out).strip()}", rc=rc)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "enabled": {"type": "list", "elements": "str", "default": []},
            "started": {"type": "list", "elements": "str", "default": []},
            "no_block": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    params = module.params
    to_enable, to_start, states = units_to_change(module, params["enabled"], params["started"])
    to_reset = [name for name in to_start if states[name] == "failed"]

    if not module.check_mode:
        if to_enable:
            _run(module, ["systemctl", "enable", "--", *to_enable])
        if to_reset:
            _run(module, ["systemctl", "reset-failed", "--", *to_reset])
        if to_start:
            _run(module, ["systemctl", "start", *(["--no-block"] if params["no_block"] else []), "--", *to_start])
    module.exit_json(changed=bool(to_enable or to_start), reset=to_reset, enabled=to_enable, started=to_start)


if __name__ == "__main__":
    main()
