"""Load what every worker would load again, once in ansible-playbook's own process.

ansible-playbook forks a worker per task and host (ansible/utils/multiprocessing.py: the 'fork'
context), and a worker loads a plugin its parent has not loaded (plugins/loader.py
`_load_module_source` reuses only what sys.modules already holds). Without this, every worker that
templated an epd.kit filter imported epd_kit.plan again, about 36 modules (0.1-0.2 CPU-s each time,
many times per deploy: docs/sandbox.md "Where the CPU goes"). Loaded here, in the parent, before
the first fork, the workers inherit:
- the kit's filters and the planner they call, and the router's settings models the inventory
  check validates with (plan/router_check.py, cached once loaded: pydantic builds them);
- Ansible's own filters and tests (each worker's first template loaded all of them);
- the parsed module_utils every Python module's payload holds (ansible/module_utils/basic.py and
  what it imports): each worker that builds a payload (once per module and run) parsed them again.
  The parse is cached per source text; it happens before the first task that runs a module.
The callback prints nothing and changes nothing: a controller without it (or an ansible-core
without the function it caches) runs the same playbooks with the same results, only with more CPU.
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import io
import zipfile

from ansible.plugins.callback import CallbackBase
from ansible.plugins.loader import filter_loader, test_loader
from ansible_collections.epd.kit.plugins.filter import epd_firewall, epd_kit, epd_observability  # noqa: F401

DOCUMENTATION = r"""
name: epd_preload
type: aggregate
short_description: load the kit's filters once, before ansible-playbook forks its workers
description:
  - Imports the epd.kit filter plugins and the planner they call (epd_kit.plan), the router's
    settings models, and Ansible's own filters and tests in the controller's main process, and
    parses the module_utils of a module's payload there before the first task that runs a module,
    so the worker forked for each task and host inherits them instead of loading them again.
  - Prints nothing and changes nothing. Enabled by the repository's ansible.cfg (callbacks_enabled);
    a controller without it runs the same playbooks with the same results, only with more CPU.
"""

# actions that run no module (the controller's own, the kit's render among them): before them
# there is no payload to build, and a playbook of only these (render.yml) parses nothing
CONTROLLER_ONLY = {"epd.kit.epd_render_files"} | frozenset(
    f"{prefix}{name}"
    for prefix in ("", "ansible.builtin.", "ansible.legacy.")
    for name in (
        "add_host", "assert", "debug", "fail", "group_by", "import_role", "import_tasks", "include_role",
        "include_tasks", "include_vars", "meta", "pause", "set_fact", "set_stats", "validate_argument_spec",
    )
)  # fmt: skip


def _cache_module_ast() -> bool:
    """Memoise module_common._compile_module_ast (ansible-core 2.19: the parse of a module's and
    each module_util's source while a payload is built) by source text; False where it is absent."""
    from ansible.executor import module_common

    parse = getattr(module_common, "_compile_module_ast", None)
    if parse is None or getattr(parse, "epd_cached", False):
        return False
    if list(inspect.signature(parse).parameters) != ["module_name", "source_code"]:
        return False  # another ansible-core's function: left as it is
    trees: dict[tuple[str, str | bytes], object] = {}

    def cached(module_name, source_code):
        key = (module_name, source_code)
        if key not in trees:
            trees[key] = parse(module_name, source_code)  # read only after: ModuleDepFinder visits it
        return trees[key]

    cached.epd_cached = True
    module_common._compile_module_ast = cached
    return True


def _parse_module_utils() -> None:
    """Parse what ansible.builtin.ping's payload holds (basic.py's closure, the part every Python
    module shares) through the cached parse, into a payload that is thrown away."""
    from ansible.executor import module_common
    from ansible.plugins.loader import module_loader

    path = module_loader.find_plugin("ansible.builtin.ping")
    with open(path, "rb") as source:
        data = source.read()
    with zipfile.ZipFile(io.BytesIO(), "w") as payload:
        module_common.recursive_finder(
            "ping",
            module_common._get_ansible_module_fqn(path),
            data,
            payload,
            datetime.datetime.now(datetime.UTC),
            module_common._builder.ExtensionManager.create(task_vars={}),
        )


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "epd.kit.epd_preload"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the planner's modules: its package loads them with their first use (plan/__init__.py)
        epd_kit.plan.load_all()
        # the router's settings models (plan/router_check.py _load, cached): pydantic builds them
        importlib.import_module(f"{epd_kit.plan.__name__}.router_check").available()
        for loader in (filter_loader, test_loader):
            list(loader.all())
        self._module_utils_pending = True

    def v2_playbook_on_task_start(self, task, is_conditional):
        if not self._module_utils_pending or task.action in CONTROLLER_ONLY:
            return
        self._module_utils_pending = False
        try:
            if _cache_module_ast():
                _parse_module_utils()
        except Exception as error:  # an ansible-core whose builder differs: the workers parse, as without this
            self._display.vvv(f"epd_preload: module_utils not preloaded: {error}")
