"""Action plugin epd.kit.epd_render_files: write a set of files under a directory of the controller
in one task (render.yml; a task per file costs a worker fork and a module run each, which made
rendering a fleet take tens of seconds).

Options:
  root: the directory every dest is under (created as needed).
  files: a list of {dest, template, vars} (a template rendered exactly as the template module
    renders it: the task's variables plus vars) or {dest, json} (written as to_nice_json(indent=2)).
  directories: dests of directories to create even when no file lands in them.
Files are written with mode 0644 and directories 0755; only files whose content differs are
rewritten. Returns changed and written (the dests rewritten). Deploy writes the hosts' files with
the template module instead (per-file change reporting, ownership, validation).

The template lookup deep-copies the variables it is given, for every file: the fleet plan among
them, so one host's render cost grew with the fleet (quadratic over the fleet: 61 s at 64 hosts,
docs/benchmarks.md "Controller at fleet scale"). It gets a mapping whose deep copy is shallow,
as the template action module's copy is (task_vars.copy()), and renders through the same code.
"""

from __future__ import annotations

from pathlib import Path

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.plugins.filter.core import to_nice_json


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        root = Path(args["root"])
        template = self._shared_loader_obj.lookup_loader.get(
            "ansible.builtin.template", loader=self._loader, templar=self._templar
        )
        variables = _ShallowCopied(task_vars)
        for directory in args.get("directories", []):
            _directory(root, directory)
        written = []
        for spec in args.get("files", []):
            if "template" in spec:
                content = template.run([spec["template"]], variables=variables, template_vars=spec.get("vars", {}))[0]
            elif "json" in spec:
                content = to_nice_json(spec["json"], indent=2)
            else:
                raise AnsibleActionFail(f"{spec.get('dest')}: give either template or json")
            if _write(_directory(root, str(Path(spec["dest"]).parent)) / Path(spec["dest"]).name, str(content)):
                written.append(spec["dest"])
        result.update(changed=bool(written), written=written)
        return result


class _ShallowCopied(dict):
    """Task variables whose deepcopy (the template lookup's, per file) is a shallow copy; the lookup
    only adds its template_* variables to the copy, which never reach the task's own."""

    def __deepcopy__(self, memo) -> dict:
        return dict(self)


def _directory(root: Path, dest: str) -> Path:
    path = root / dest.lstrip("/")
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    return path


def _write(path: Path, content: str) -> bool:
    if path.is_file() and path.read_text() == content:
        return False
    path.write_text(content)
    path.chmod(0o644)
    return True
