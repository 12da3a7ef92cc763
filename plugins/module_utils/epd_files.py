"""The comparison and the write of epd_files, shared with epd_host_state, whose read reports the
paths an epd_files run with the same entries would change (and changes nothing): a role whose read
finds none skips its write, a module run less in every deploy that changes nothing."""

from __future__ import annotations

import grp
import os
import pwd
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


# epd_files' argument spec of one entry
ENTRY_OPTIONS = {
    "path": {"type": "path", "required": True},
    "content": {"type": "str"},
    "owner": {"type": "str", "required": True},
    "group": {"type": "str", "required": True},
    "mode": {"type": "str", "required": True},
    "validate": {"type": "str"},
}


def _known(entry: dict) -> bool:
    """Whether the host knows the entry's owner and group (names or ids)."""
    try:
        for name, lookup in ((entry["owner"], pwd.getpwnam), (entry["group"], grp.getgrnam)):
            if not str(name).isdigit():
                lookup(name)
    except KeyError:
        return False
    return True


def would_change(module: AnsibleModule, entries: list[dict]) -> list[str]:
    """The paths epd_files would change for these entries, as its check mode finds them (the same
    comparison: content, existence, owner, group, mode), without writing anything. An entry the
    check could not judge without failing counts as one to change, and the write says what is
    wrong: a file whose directory is missing (made by no earlier entry), an owner or group the
    host does not know yet (a read before the role creates its user)."""
    check_mode, module.check_mode = module.check_mode, True
    try:
        directories: list[bytes] = []
        changed = []
        for entry in entries:
            b_parent = os.path.dirname(to_bytes(entry["path"], errors="surrogate_or_strict"))
            missing_parent = entry.get("content") is not None and not os.path.isdir(b_parent)
            if (
                (missing_parent and not _made_by(directories, b_parent))
                or not _known(entry)
                or apply_entry(module, entry, [], directories)
            ):
                changed.append(entry["path"])
        return changed
    finally:
        module.check_mode = check_mode


def apply_entry(module: AnsibleModule, entry: dict, diffs: list[dict], directories: list[bytes]) -> bool:
    """Make one entry so (in check mode: find whether it is); True when it changed (would change)."""
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
