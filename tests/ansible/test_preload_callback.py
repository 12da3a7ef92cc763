"""ansible.cfg's epd.kit.epd_preload callback (plugins/callback/epd_preload.py): ansible-playbook's
own process imports the kit's planner before it forks a worker per task and host, so the workers
inherit it (docs/sandbox.md "Where the CPU goes"). A callback that fails to load is only a warning
in ansible-playbook's output, and the workers then import the planner again, each; so this checks
that it loads and what it loaded, in a playbook run with the repository's ansible.cfg."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.ansible.helpers import playbook

pytestmark = pytest.mark.ansible

# python -X importtime's line for a module the process imported (ansible's workers write nothing to
# this stderr: what it shows is the main process's). The package itself has no line of its own: the
# filter imports it with importlib.import_module, which importtime does not log; its modules do.
PLANNER_IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s+epd_kit\.plan\.variables$", re.M)


def test_the_main_process_loads_the_planner_before_the_first_task(tmp_path: Path):
    # no task uses a filter: whatever imported the planner is the callback, before any fork
    book = tmp_path / "play.yml"
    play = {"hosts": "localhost", "connection": "local", "gather_facts": False}
    play["tasks"] = [{"name": "A task a worker runs", "ansible.builtin.debug": {"msg": "ok"}}]
    book.write_text(yaml.safe_dump([play]))
    result = playbook("-i", "localhost,", str(book), PYTHONPROFILEIMPORTTIME="1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert "Skipping callback" not in output, output[-2000:]
    imported = PLANNER_IMPORTED.findall(result.stderr)
    assert len(imported) == 1, "ansible-playbook's own process did not import epd_kit.plan before the task"
