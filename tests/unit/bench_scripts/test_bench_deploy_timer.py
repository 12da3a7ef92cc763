"""bench/deploy_timer.py's parts that need no test host: the per-task timer callback under a real
ansible-playbook run on this machine, and the summary of several runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from bench import deploy_timer
from tests.budget import scaled
from tests.hosts.harness import REPO


def test_the_timer_records_each_task_its_hosts_and_those_that_changed(tmp_path):
    book = tmp_path / "book.yml"
    play = {
        "name": "Timed",
        "hosts": "localhost",
        "connection": "local",
        "gather_facts": False,
        "vars": {"ansible_python_interpreter": sys.executable},
        "tasks": [
            {"name": "Changes", "ansible.builtin.command": "sleep 0.3", "changed_when": True},
            {"name": "Skipped", "ansible.builtin.debug": {"msg": "x"}, "when": False},
            {"name": "Reads", "ansible.builtin.command": "true", "changed_when": False},
        ],
    }
    book.write_text(yaml.safe_dump([play], sort_keys=False))
    out = tmp_path / "timer.json"
    env = dict(
        os.environ,
        ANSIBLE_CALLBACK_PLUGINS=str(deploy_timer.CALLBACKS),
        ANSIBLE_CALLBACKS_ENABLED="epd_task_timer",
        EPD_TASK_TIMER_OUT=str(out),
    )
    playbook = Path(sys.executable).parent / "ansible-playbook"
    done = subprocess.run(
        [str(playbook), "-i", "localhost,", str(book)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    timer = json.loads(out.read_text())
    tasks = {t["task"]: t for t in timer["tasks"]}
    assert list(tasks) == ["Changes", "Skipped", "Reads"]
    assert tasks["Changes"]["changed"] == ["localhost"] and tasks["Changes"]["seconds"] >= 0.3
    assert tasks["Skipped"]["hosts"] == [] and tasks["Reads"]["hosts"] == ["localhost"]
    assert tasks["Skipped"]["skipped"] == ["localhost"] and tasks["Reads"]["skipped"] == []  # a fork, no module run
    assert tasks["Reads"]["changed"] == []
    assert [p["play"] for p in timer["plays"]] == ["Timed"] and timer["plays"][0]["seconds"] >= 0.3
    assert timer["recap"]["localhost"]["changed"] == 1


def test_the_summary_ranks_tasks_by_their_mean_over_the_runs():
    def run(wall, seconds, changed=0):
        tasks = [{"play": "p", "task": name, "seconds": s, "changed": []} for name, s in seconds.items()]
        return {
            "wall_s": wall,
            "controller_cpu_s": wall / 2,
            "hosts_cpu_s": 1.0,
            "load": 1.0,
            "changed": {"n1": changed},
            "changed_tasks": [],
            "tasks": tasks,
            "task_count": len(tasks),
            "module_runs": 1,
            "skipped_forks": 2,
        }

    summary = deploy_timer.summary(
        [run(10, {"a": 1.0, "b": 3.0}), run(14, {"a": 5.0, "b": 1.0}), run(12, {"a": 0, "b": 2})]
    )
    assert summary["median_s"] == 12 and summary["changed"] == [0, 0, 0]
    assert summary["module_runs"] == 1 and summary["skipped_forks"] == 2
    assert summary["cpu_s"] == [6.0, 8.0, 7.0] and summary["median_cpu_s"] == 7.0
    assert [(t["task"], t["mean_s"], t["max_s"]) for t in summary["top"]] == [("a", 2.0, 5.0), ("b", 2.0, 3.0)]
