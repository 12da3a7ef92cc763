#!/usr/bin/python
"""Ansible module: read the files, file names and unit states a role decides on, in one run."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: epd_host_state
short_description: Read several files, globs, owners, groups and systemd unit states of a host in one module run
description:
  - What a role reads before it decides (which engines run, what their env files and unit say,
    which restart marks a stopped rollout left), in one start of the host's Python instead of one
    M(ansible.builtin.slurp), M(ansible.builtin.find) or C(systemctl) task per fact; each of
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
  unit_patterns:
    description:
      - Unit name patterns (C(systemctl list-units) syntax, C(epd-router@*.service)); each returns
        the loaded units it matches that run or are on their way (active, activating, reloading).
    type: list
    elements: str
    default: []
  unit_changes:
    description:
      - What M(epd.kit.epd_units) with these C(enabled) and C(started) lists would do, read the
        same way (one C(systemctl is-enabled), one C(systemctl is-active)) and changing nothing.
        A role whose read finds nothing to enable or start skips its epd_units run (a module run
        of about 0.3 s of CPU on the host in every deploy).
    type: dict
    default: {}
    suboptions:
      enabled:
        description: Units to enable.
        type: list
        elements: str
        default: []
      started:
        description: Units to start.
        type: list
        elements: str
        default: []
  file_changes:
    description:
      - Entries as M(epd.kit.epd_files) takes them (path, content for a file or none for a
        directory, owner, group, mode, validate); returns the paths an epd_files run with them
        would change, found by its own comparison, and writes nothing. A role whose read finds
        none skips its write (a module run less in a deploy that changes nothing). No secrets
        here - the read is not no_log, and its arguments show with -v.
    type: list
    elements: dict
    default: []
  listeners:
    description:
      - TCP ports to probe for listeners, as M(epd.kit.epd_listen_probe) does (the same code), so
        that the preflight reads the host and probes its ports in one run.
    type: list
    elements: int
    default: []
  groups:
    description: Group names; each returns whether the host knows it (through NSS, as C(getent group) does).
    type: list
    elements: str
    default: []
  owners:
    description: Paths whose owner to read (user name, or the uid when no user has it); a missing path reads as null.
    type: list
    elements: path
    default: []
  users:
    description:
      - User names; each returns its account (as C(getent passwd) and C(id -Gn) show it), or null
        when the host has no such user.
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
    unit_patterns: [epd-router@*.service]
    unit_changes: {enabled: [epd.target, epd-engine@pd0.service], started: [epd-engine@pd0.service]}
    groups: [neuron]
    owners: [/var/cache/epd/compile]
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
unit_patterns:
  description: Pattern to the sorted names of the running units it matches.
  type: dict
  returned: always
  sample: {"epd-router@*.service": ["epd-router@0.service", "epd-router@1.service"]}
unit_changes:
  description: The units of C(enabled) that are not enabled, and those of C(started) that do not run or start.
  type: dict
  returned: always
  sample: {"enable": [], "start": ["epd-engine@pd-1.service"]}
file_changes:
  description: The paths of C(file_changes) an epd_files run would change (or could not judge without failing).
  type: list
  elements: str
  returned: always
listeners:
  description:
    - The listeners on the C(listeners) ports, C(conflicts) (not the kit's) and C(own) (the kit's
      units'), as M(epd.kit.epd_listen_probe) returns them; both empty without ports.
  type: dict
  returned: always
  sample: {"conflicts": [{"port": 18100, "address": "0.0.0.0", "pid": 4242, "process": "nc -l 18100"}], "own": []}
groups:
  description: Group name to whether it exists.
  type: dict
  returned: always
owners:
  description: Path to its owner's user name (null when the path is missing).
  type: dict
  returned: always
users:
  description: User name to its account (null when missing) - primary group, every group it is in, home, shell.
  type: dict
  returned: always
  sample: {"epd": {"group": "epd", "groups": ["epd", "neuron"], "home": "/var/cache/epd", "shell": "/usr/sbin/nologin"}}
"""

import glob
import grp
import os
import pwd

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.epd.kit.plugins.module_utils.epd_files import ENTRY_OPTIONS, would_change
from ansible_collections.epd.kit.plugins.module_utils.epd_listen import probe
from ansible_collections.epd.kit.plugins.module_utils.epd_systemd import active_states, units_to_change


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _owner(path: str) -> str | None:
    try:
        uid = os.stat(path).st_uid
    except FileNotFoundError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid no user has any more (a teardown removed the user)
        return str(uid)


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _user(name: str) -> dict | None:
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        return None
    every = grp.getgrall()
    primary = next((g.gr_name for g in every if g.gr_gid == account.pw_gid), str(account.pw_gid))
    groups = sorted({primary} | {g.gr_name for g in every if name in g.gr_mem})
    return {"group": primary, "groups": groups, "home": account.pw_dir, "shell": account.pw_shell}


def _running_units(module: AnsibleModule, pattern: str) -> list[str]:
    argv = ["systemctl", "list-units", "--plain", "--no-legend", "--state=active,activating,reloading", "--", pattern]
    _rc, out, _err = module.run_command(argv, check_rc=True)
    return sorted(line.split()[0] for line in out.splitlines() if line.strip())


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {"type": "list", "elements": "path", "default": []},
            "globs": {"type": "dict", "default": {}},
            "units": {"type": "list", "elements": "str", "default": []},
            "unit_patterns": {"type": "list", "elements": "str", "default": []},
            "unit_changes": {
                "type": "dict",
                "default": {},
                "options": {
                    "enabled": {"type": "list", "elements": "str", "default": []},
                    "started": {"type": "list", "elements": "str", "default": []},
                },
            },
            "file_changes": {"type": "list", "elements": "dict", "default": [], "options": ENTRY_OPTIONS},
            "listeners": {"type": "list", "elements": "int", "default": []},
            "groups": {"type": "list", "elements": "str", "default": []},
            "owners": {"type": "list", "elements": "path", "default": []},
            "users": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    params = module.params
    to_enable, to_start, _states = units_to_change(
        module, params["unit_changes"]["enabled"], params["unit_changes"]["started"]
    )
    module.exit_json(
        changed=False,
        files={path: _read(path) for path in params["files"]},
        globs={name: sorted(glob.glob(str(pattern))) for name, pattern in params["globs"].items()},
        units=active_states(module, params["units"]),
        unit_patterns={pattern: _running_units(module, pattern) for pattern in params["unit_patterns"]},
        unit_changes={"enable": to_enable, "start": to_start},
        file_changes=would_change(module, params["file_changes"]),
        listeners=probe(module, params["listeners"]),
        groups={name: _group_exists(name) for name in params["groups"]},
        owners={path: _owner(path) for path in params["owners"]},
        users={name: _user(name) for name in params["users"]},
    )


if __name__ == "__main__":
    main()
