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

import os
import re
import shlex
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_bytes

OCTAL_MODE = re.compile(r"^0?[0-7]{3,4}$")


def _read(path: bytes) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _replace(module: AnsibleModule, path: bytes, content: bytes, validate: str | None) -> None:
    """Write beside the target, check it (validate), then rename over it: a reader never sees half
    a file, nor one its checker refused."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=b"." + os.path.basename(path) + b".")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        if validate:
            argv = [arg.replace("%s", tmp.decode()) for arg in shlex.split(validate)]
            rc, out, err = module.run_command(argv, check_rc=False)
            if rc != 0:
                module.fail_json(
                    msg=f"{path.decode()}: the new content failed validation ({validate}, rc {rc}): "
                    f"{(err or out).strip()}",
                    rc=rc,
                    stdout=out,
                    stderr=err,
                )
        module.atomic_move(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _made_by(directories: list[bytes], parent: bytes) -> bool:
    """Whether an earlier directory entry creates `parent` (itself or as one of its parents)."""
    return any(d == parent or d.startswith(parent.rstrip(b"/") + b"/") for d in directories)


def _apply(module: AnsibleModule, entry: dict, diffs: list[dict], directories: list[bytes]) -> bool:
    path = entry["path"]
    b_path = to_bytes(path, errors="surrogate_or_strict")
    if not os.path.isabs(path):
        module.fail_json(msg=f"{path}: the path must be absolute")
    if not OCTAL_MODE.match(entry["mode"]):
        module.fail_json(msg=f"{path}: mode {entry['mode']!r} is not an octal mode such as '0644'")
    if entry.get("validate") and "%s" not in entry["validate"]:
        module.fail_json(msg=f"{path}: validate {entry['validate']!r} must name the file to check as %s")
    is_directory = entry.get("content") is None
    existed = os.path.lexists(b_path)
    diff: dict = {"before_header": path, "after_header": path, "before": {}, "after": {}}
    changed = False
    if is_directory:
        directories.append(os.path.normpath(b_path))
        if os.path.lexists(b_path) and not os.path.isdir(b_path):
            module.fail_json(msg=f"{path}: exists and is not a directory")
        if not os.path.isdir(b_path):
            changed = True
            diff["before"]["state"], diff["after"]["state"] = "absent", "directory"
            if not module.check_mode:
                os.makedirs(b_path)
    else:
        if os.path.isdir(b_path):
            module.fail_json(msg=f"{path}: is a directory, not a file")
        parent = os.path.dirname(b_path)
        if not os.path.isdir(parent) and not (module.check_mode and _made_by(directories, parent)):
            module.fail_json(msg=f"{path}: the directory {os.path.dirname(path)} does not exist")
        new = to_bytes(entry["content"], errors="surrogate_or_strict")
        old = _read(b_path) if os.path.isdir(parent) else None
        if old != new:
            changed = True
            diff["before"] = "" if old is None else old.decode("utf-8", "replace")
            diff["after"] = entry["content"]
            if not module.check_mode:
                _replace(module, b_path, new, entry.get("validate"))
    if os.path.exists(b_path):  # a new path in check mode has no attributes to compare yet
        attributes = module.load_file_common_arguments(
            {"path": path, "owner": entry["owner"], "group": entry["group"], "mode": entry["mode"]}
        )
        attribute_diff: dict = {}
        changed = module.set_fs_attributes_if_different(attributes, changed, diff=attribute_diff)
        if existed and isinstance(diff["before"], dict):
            diff["before"].update(attribute_diff.get("before", {}))
            diff["after"].update(attribute_diff.get("after", {}))
    if changed:
        diffs.append(diff)
    return changed


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {
                "type": "list",
                "elements": "dict",
                "required": True,
                "options": {
                    "path": {"type": "path", "required": True},
                    "content": {"type": "str"},
                    "owner": {"type": "str", "required": True},
                    "group": {"type": "str", "required": True},
                    "mode": {"type": "str", "required": True},
                    "validate": {"type": "str"},
                },
            }
        },
        supports_check_mode=True,
    )
    diffs: list[dict] = []
    directories: list[bytes] = []  # in check mode, a later file's parent may be one of them
    changed_paths = [entry["path"] for entry in module.params["files"] if _apply(module, entry, diffs, directories)]
    result: dict = {"changed": bool(changed_paths), "changed_paths": changed_paths}
    if module._diff:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
