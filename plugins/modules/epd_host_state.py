#!/usr/bin/python
"""Ansible module: read the files, file names and unit states a role decides on, in one run."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: epd_host_state
short_description: Read several files, globs and systemd unit states of a host in one module run
description:
  - What a role reads before it decides (which engines run, what their env files and unit say,
    which restart marks a stopped rollout left), in one start of the host's Python instead of one
    M(ansible.builtin.slurp), M(ansible.builtin.find) or C(systemctl) task per fact: each of
    those costs a module run of about 0.3 s of CPU on the host (docs/sandbox.md).
  - Read-only; supports check mode.
options:
  files:
    description: Paths to read as UTF-8 text. A missing file reads as null.
    type: list
    elements: path
    default: []
  globs:
    description: Name to shell pattern (M(glob.glob) syntax); each name returns the matching paths, sorted.
    type: dict
    default: {}
  units:
    description: Unit names whose state to read, as C(systemctl is-active) prints it.
    type: list
    elements: str
    default: []
author: epd-kit
"""

EXAMPLES = r"""
- name: Read what the host runs now
  epd.kit.epd_host_state:
    units: [epd-engine@pd0.service]
    files: [/etc/epd/engines/pd0.env]
    globs: {pending: /etc/epd/engines/*.pending}
  register: state
"""

RETURN = r"""
files:
  description: Path to content (null when the file is missing).
  type: dict
  returned: always
globs:
  description: Name to the sorted paths its pattern matches.
  type: dict
  returned: always
units:
  description: Unit to its state (active, inactive, failed, activating, ...).
  type: dict
  returned: always
  sample: {"epd-engine@pd0.service": "active"}
"""

import glob

from ansible.module_utils.basic import AnsibleModule


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _unit_states(module: AnsibleModule, units: list[str]) -> dict[str, str]:
    if not units:
        return {}
    # one line per unit, in order; the exit code is non-zero as soon as one is not active
    _rc, out, err = module.run_command(["systemctl", "is-active", "--", *units], check_rc=False)
    states = out.splitlines()
    if len(states) != len(units):
        module.fail_json(msg=f"systemctl is-active printed {len(states)} states for {len(units)} units: {err.strip()}")
    return dict(zip(units, states, strict=True))


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {"type": "list", "elements": "path", "default": []},
            "globs": {"type": "dict", "default": {}},
            "units": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    params = module.params
    module.exit_json(
        changed=False,
        files={path: _read(path) for path in params["files"]},
        globs={name: sorted(glob.glob(str(pattern))) for name, pattern in params["globs"].items()},
        units=_unit_states(module, params["units"]),
    )


if __name__ == "__main__":
    main()
