#!/usr/bin/python
"""Ansible module: write a set of files and directories on a host in one module run."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: epd_files
short_description: Write several files and directories on a host in one module run
description:
  - Each entry is a file with the given content or, without content, a directory. A file is
    written only when its content differs (to a temporary file beside it, then renamed over it);
    owner, group and mode are set when they differ. A file's directory must exist or be an
    earlier entry of the list.
  - Why not a loop of M(ansible.builtin.template) or M(ansible.builtin.file)? Each item of such a
    loop starts the host's Python two times (a stat, then the copy or the attribute check), and a
    no-op deploy spent most of its time in those starts (docs/sandbox.md, "Where the e2e tier's
    CPU goes"). Render the content on the controller with the template lookup and pass it here.
  - Reports which paths changed (C(changed_paths)), so that a task after it can react to one
    file of the set. Supports check mode and diff mode (one diff per changed path).
  - A secret's content is a module argument, which a diff shows and the host's journal would log.
    Give a secret a task of its own with C(no_log) set, which withholds the task's result and diff
    and the module's journal entry (AnsibleModule logs nothing under no_log), and put nothing
    else in that task, since its result then names no path either.
options:
  files:
    description: The files and directories, written in this order.
    type: list
    elements: dict
    required: true
    suboptions:
      path:
        description: Absolute path.
        type: path
        required: true
      content:
        description: The file's content. Omit it for a directory (created with its parents).
        type: str
      owner:
        description: Owner name.
        type: str
        required: true
      group:
        description: Group name.
        type: str
        required: true
      mode:
        description: Octal mode as a string, such as C("0644").
        type: str
        required: true
      validate:
        description:
          - A command that checks the new content before it replaces the file, with C(%s) for the
            path of the written temporary file (as M(ansible.builtin.template)'s C(validate)). Run only
            when the content differs; a failure leaves the file as it was and fails the task with
            the command's output. Empty or omitted, nothing checks it.
        type: str
author: epd-kit
"""

EXAMPLES = r"""
- name: Write the router's units
  epd.kit.epd_files:
    files:
      - path: /etc/systemd/system/epd-router.socket
        content: "{{ lookup('ansible.builtin.template', 'epd-router.socket.j2') }}"
        owner: root
        group: root
        mode: "0644"
      - path: /etc/epd
        owner: root
        group: epd
        mode: "0750"
  register: router_units
"""

RETURN = r"""
changed_paths:
  description: The paths whose content, existence, owner, group or mode changed (or would, in check mode).
  type: list
  elements: str
  returned: always
  sample: ["/etc/systemd/system/epd-router.socket"]
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.epd.kit.plugins.module_utils.epd_files import ENTRY_OPTIONS, apply_entry


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {
                "type": "list",
                "elements": "dict",
                "required": True,
                "options": ENTRY_OPTIONS,
            }
        },
        supports_check_mode=True,
    )
    diffs: list[dict] = []
    directories: list[bytes] = []  # in check mode, a later file's parent may be one of them
    changed_paths = [
        entry["path"] for entry in module.params["files"] if apply_entry(module, entry, diffs, directories)
    ]
    result: dict = {"changed": bool(changed_paths), "changed_paths": changed_paths}
    if module._diff:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
