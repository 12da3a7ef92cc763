"""Action plugin epd.kit.epd_render_files: write the files of several hosts under directories of
the controller in one task (render.yml).

Options:
  hosts: the inventory hosts to render, each with its own variables: those this task would run
    with on that host (inventory, play, role defaults, the plan's facts).
  shared_vars: variables templated once, in this task's own context, and given to every host's
    templating (what is the same for the hosts of the task: computed once, not once per host).
  each_host: the name of a variable (the task's own vars) that, templated with a host's variables,
    says what to write for that host, {root, files, directories}:
      root: the directory every dest is under (created as needed).
      files: a list of {dest, template, vars} (a template rendered exactly as the template module
        renders it: the host's variables plus vars), {dest, json} (written as to_nice_json(indent=2))
        or {dest, content} (the text itself); each may give mode (an octal string, default 0644:
        a placeholder secret file is 0600 or 0640, as the router's check requires).
      directories: dests of directories to create even when no file lands in them.
Files are written with mode 0644 and directories 0755; only files whose content differs are
rewritten. Returns changed and written ({host: the dests rewritten}). Deploy writes the hosts'
files with the template module instead (per-file change reporting, ownership, validation).

One task for many hosts, not one per host: a task per host cost a worker process that compiled
every template and variable expression again (docs/benchmarks.md "Controller at fleet scale").
Here each is compiled once for all the hosts of the task.

The template lookup deep-copies the variables it is given, for every file: the fleet plan among
them, so one host's render cost grew with the fleet. It gets a mapping whose deep copy is shallow,
as the template action module's copy is (task_vars.copy()), and renders through the same code.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.plugins.action import ActionBase
from ansible.plugins.filter.core import to_nice_json


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        written = {}
        with _compiled_once():
            for host in self._task.args["hosts"]:
                try:
                    variables = {**self._host_variables(host, task_vars), **self._task.args.get("shared_vars", {})}
                    templar = self._templar.copy_with_new_env(available_variables=variables)
                    dests = self._render(templar.template(variables[self._task.args["each_host"]]), variables, templar)
                except AnsibleError as error:
                    raise AnsibleActionFail(f"rendering {host}: {error}") from None
                if dests:
                    written[host] = dests
        result.update(changed=bool(written), written=written)
        return result

    def _host_variables(self, host: str, task_vars: dict) -> dict:
        """The variables this task would run with on `host`, as the strategy computes them for a task
        (the variable manager and the inventory have no public accessor in an action plugin)."""
        manager = self._task._variable_manager
        host_object = manager._inventory.get_host(host)
        variables = manager.get_vars(play=self._task.get_play(), host=host_object, task=self._task)
        variables["ansible_search_path"] = task_vars["ansible_search_path"]  # the task's, set by its executor
        return variables

    def _render(self, spec: dict, variables: dict, templar) -> list[str]:
        root = Path(spec["root"])
        template = self._shared_loader_obj.lookup_loader.get(
            "ansible.builtin.template", loader=self._loader, templar=templar
        )
        shallow = _ShallowCopied(variables)
        for directory in spec.get("directories", []):
            _directory(root, directory)
        written = []
        for file in spec.get("files", []):
            if "template" in file:
                content = template.run([file["template"]], variables=shallow, template_vars=file.get("vars", {}))[0]
            elif "json" in file:
                content = to_nice_json(file["json"], indent=2)
            elif "content" in file:
                content = file["content"]
            else:
                raise AnsibleActionFail(f"{file.get('dest')}: give template, json or content")
            mode = int(str(file.get("mode", "0644")), 8)
            if _write(_directory(root, str(Path(file["dest"]).parent)) / Path(file["dest"]).name, str(content), mode):
                written.append(file["dest"])
        return written


@contextlib.contextmanager
def _compiled_once() -> Iterator[None]:
    """Compile each template and variable expression once for all the hosts of the task.

    ansible-core 2.19 compiles (parses, generates and byte-compiles) a template string each time it
    renders it, and every template lookup makes a new Jinja environment that resolves its filter
    plugins again: most of a host's render. A compiled template depends on its source and the compile
    options only (the variables come at render time); one compiled here keeps the environment it was
    made in, whose filters are then resolved once. A compile error is not kept (it holds the templar
    that met it). Other ansible-core versions (without these internals) compile as before."""
    try:
        from ansible._internal._templating._engine import TemplateEngine
        from ansible._internal._templating._jinja_bits import AnsibleTemplate, AnsibleTemplateExpression
    except ImportError:
        yield
        return
    originals = {name: getattr(TemplateEngine, name, None) for name in ("_compile_template", "_compile_expression")}
    if None in originals.values():
        yield
        return
    compiled: dict = {}
    try:
        for name, original in originals.items():
            setattr(TemplateEngine, name, _cached(original, compiled, (AnsibleTemplate, AnsibleTemplateExpression)))
        yield
    finally:
        for name, original in originals.items():
            setattr(TemplateEngine, name, original)


def _cached(compile_: Callable, compiled: dict, kept: tuple[type, ...]) -> Callable:
    @functools.wraps(compile_)
    def compile_once(engine, source: str, options):
        # the loader's search path only matters to includes, which the kit's templates have none of
        searchpath = tuple(getattr(engine.environment.loader, "searchpath", ()))
        key = (compile_.__name__, source, options, engine.basedir, searchpath)
        try:
            found = compiled.get(key)
        except TypeError:  # options this ansible-core cannot hash: compile as it would
            return compile_(engine, source, options)
        if found is None:
            found = compile_(engine, source, options)
            if isinstance(found, kept):
                compiled[key] = found
        return found

    return compile_once


class _ShallowCopied(dict):
    """Task variables whose deepcopy (the template lookup's, per file) is a shallow copy; the lookup
    only adds its template_* variables to the copy, which never reach the task's own."""

    def __deepcopy__(self, memo) -> dict:
        return dict(self)


def _directory(root: Path, dest: str) -> Path:
    path = root / dest.lstrip("/")
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    return path


def _write(path: Path, content: str, mode: int = 0o644) -> bool:
    if path.is_file() and path.read_text() == content and (path.stat().st_mode & 0o777) == mode:
        return False
    path.write_text(content)
    path.chmod(mode)
    return True
