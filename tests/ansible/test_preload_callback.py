"""ansible.cfg's epd.kit.epd_preload callback (plugins/callback/epd_preload.py): ansible-playbook's
own process imports the kit's planner before it forks a worker per task and host, so the workers
inherit it (docs/sandbox.md "Where the CPU goes"). A callback that fails to load is only a warning
in ansible-playbook's output, and the workers then import the planner again, each; so this checks
that it loads and what it loaded, in a playbook run with the repository's ansible.cfg."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.ansible.helpers import BIN, playbook, run

pytestmark = pytest.mark.ansible

# python -X importtime's line for a module the process imported (ansible's workers write nothing to
# this stderr: what it shows is the main process's). The package itself has no line of its own: the
# filter imports it with importlib.import_module, which importtime does not log; its modules do.
PLANNER_IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s+epd_kit\.plan\.variables$", re.M)


def main_process_imports(tmp_path: Path) -> str:
    """`python -X importtime`'s lines of a play whose one task (a debug) uses no filter and checks
    no inventory: whatever imported the kit's modules is the callback, before any fork."""
    book = tmp_path / "play.yml"
    play = {"hosts": "localhost", "connection": "local", "gather_facts": False}
    play["tasks"] = [{"name": "A task a worker runs", "ansible.builtin.debug": {"msg": "ok"}}]
    book.write_text(yaml.safe_dump([play]))
    result = playbook("-i", "localhost,", str(book), PYTHONPROFILEIMPORTTIME="1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert "Skipping callback" not in output, output[-2000:]
    return result.stderr


def test_the_main_process_loads_the_planner_before_the_first_task(tmp_path: Path):
    imported = PLANNER_IMPORTED.findall(main_process_imports(tmp_path))
    assert len(imported) == 1, "ansible-playbook's own process did not import epd_kit.plan before the task"


# the router's settings models (epd_kit/router_yaml.py) the inventory check validates with
ROUTER_MODELS_IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s+epd_kit\.router_yaml$", re.M)


def test_the_main_process_loads_the_router_models_before_the_first_task(tmp_path: Path):
    stderr = main_process_imports(tmp_path)
    assert len(ROUTER_MODELS_IMPORTED.findall(stderr)) == 1, stderr[-2000:]


# The callback's hooks as ansible-playbook calls them, in a Python of its own (it replaces a
# function of ansible's module builder in the process): before a task that runs a module the
# main process parses basic.py's closure once, and a payload built after (as in a forked worker)
# parses only the module_utils that closure lacks.
MODULE_UTILS_SCRIPT = r"""
import json, os, types
from ansible.executor import module_common
from ansible.plugins.loader import init_plugin_loader, module_loader
from ansible.template import Templar

init_plugin_loader([os.path.abspath(".collections")])
parsed = []
parse = module_common._compile_module_ast
def counted(module_name, source_code):  # the names the callback's signature check expects
    parsed.append(module_name)
    return parse(module_name, source_code)
module_common._compile_module_ast = counted

from ansible_collections.epd.kit.plugins.callback import epd_preload

callback = epd_preload.CallbackModule()
callback.v2_playbook_on_task_start(types.SimpleNamespace(action="ansible.builtin.set_fact"), False)
after_set_fact = list(parsed)
callback.v2_playbook_on_task_start(types.SimpleNamespace(action="ansible.builtin.command"), False)
after_command = list(parsed)
callback.v2_playbook_on_task_start(types.SimpleNamespace(action="ansible.builtin.file"), False)
after_file = list(parsed)
path = module_loader.find_plugin("ansible.builtin.stat")
built = module_common._find_module_utils(
    module_name="stat", b_module_data=open(path, "rb").read(), module_path=path, module_args={},
    task_vars={"ansible_python_interpreter": "/usr/bin/python3"}, templar=Templar(loader=None),
    module_compression="ZIP_DEFLATED", async_timeout=0, become_plugin=None, environment={},
)
print(json.dumps({"set_fact": after_set_fact, "command": after_command, "file": after_file,
                  "stat": parsed[len(after_file):], "payload": len(built.b_module_data)}))
"""


def test_the_main_process_parses_the_module_utils_once_before_the_first_module(tmp_path: Path):
    result = run([str(BIN / "python"), "-c", MODULE_UTILS_SCRIPT], ANSIBLE_LOCAL_TEMP=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["set_fact"] == [], "a controller-only task has no payload: nothing to parse before it"
    assert "ansible.module_utils.basic" in seen["command"]
    assert seen["file"] == seen["command"], "parsed once: the first task that runs a module"
    assert seen["payload"] > 0
    assert "ansible.module_utils.basic" not in seen["stat"], seen["stat"]
    assert not set(seen["stat"]) & set(seen["command"]), "a module_util parsed again"
