"""A per-task timer for ansible-playbook (bench/deploy_timer.py): each task's wall time (from its
start to the next task's), the hosts it ran on and those that reported changed, written as JSON to
$EPD_TASK_TIMER_OUT at the end of the run. Enabled only on request:

    ANSIBLE_CALLBACK_PLUGINS=bench/callback_plugins ANSIBLE_CALLBACKS_ENABLED=epd_task_timer \
    EPD_TASK_TIMER_OUT=/tmp/t.json ansible-playbook ...

(ansible-core ships no task timer; ansible.posix's profile_tasks prints, this one keeps the
figures for a table.)"""

from __future__ import annotations

import json
import os
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: epd_task_timer
type: aggregate
short_description: per-task wall time and changed hosts as JSON (bench/deploy_timer.py)
description: Writes each task's wall time, hosts and changed hosts to $EPD_TASK_TIMER_OUT.
requirements: [enable in the callbacks_enabled setting]
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "epd_task_timer"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self.start = time.monotonic()
        self.play = ""
        self.tasks: list[dict] = []
        self.plays: list[dict] = []

    def _close(self) -> None:
        now = time.monotonic()
        if self.tasks and "seconds" not in self.tasks[-1]:
            self.tasks[-1]["seconds"] = round(now - self.tasks[-1].pop("t0"), 3)
        if self.plays and "seconds" not in self.plays[-1]:
            self.plays[-1]["seconds"] = round(now - self.plays[-1].pop("t0"), 3)

    def _task(self, task, handler: bool = False) -> None:
        now = time.monotonic()
        if self.tasks and "seconds" not in self.tasks[-1]:
            self.tasks[-1]["seconds"] = round(now - self.tasks[-1].pop("t0"), 3)
        role = task._role.get_name() if getattr(task, "_role", None) else ""
        name = task.get_name().strip()
        self.tasks.append(
            {
                "play": self.play,
                "task": name if not role or name.startswith(role) else f"{role} : {name}",
                "action": task.action,
                "handler": handler,
                "hosts": [],
                "changed": [],
                # hosts whose `when:` was false: a worker forked on the controller, no module run
                "skipped": [],
                "t0": now,
            }
        )

    def v2_playbook_on_play_start(self, play) -> None:
        self._close()
        self.play = play.get_name().strip()
        self.plays.append({"play": self.play, "t0": time.monotonic()})

    def v2_playbook_on_task_start(self, task, is_conditional) -> None:
        self._task(task)

    def v2_playbook_on_handler_task_start(self, task) -> None:
        self._task(task, handler=True)

    def _result(self, result, status: str) -> None:
        if not self.tasks:
            return
        host = result._host.get_name()
        entry = self.tasks[-1]
        if status != "skipped" and host not in entry["hosts"]:
            entry["hosts"].append(host)
        if status == "skipped" and host not in entry["skipped"] + entry["hosts"]:
            entry["skipped"].append(host)
        if result._result.get("changed") and host not in entry["changed"]:
            entry["changed"].append(host)

    def v2_runner_on_ok(self, result) -> None:
        self._result(result, "ok")

    def v2_runner_on_failed(self, result, ignore_errors: bool = False) -> None:
        self._result(result, "failed")

    def v2_runner_on_skipped(self, result) -> None:
        self._result(result, "skipped")

    def v2_runner_on_unreachable(self, result) -> None:
        self._result(result, "unreachable")

    def v2_playbook_on_stats(self, stats) -> None:
        self._close()
        out = os.environ.get("EPD_TASK_TIMER_OUT")
        if not out:
            return
        hosts = sorted(stats.processed)
        summary = {host: stats.summarize(host) for host in hosts}
        with open(out, "w") as handle:
            json.dump(
                {
                    "seconds": round(time.monotonic() - self.start, 3),
                    "plays": self.plays,
                    "tasks": self.tasks,
                    "recap": summary,
                },
                handle,
                indent=1,
            )
