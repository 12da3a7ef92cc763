#!/usr/bin/python
"""Ansible module: where each engine unit of this host is on its way to ready, from systemd and the engine's log."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: epd_engine_progress
short_description: Startup phase and elapsed time of EPD engine units
description:
  - For each epd-engine@<instance>.service, reads the unit's state from systemd (a queued job,
    ActiveState, SubState, when this start began) and, while it starts, the engine's log lines of
    this start from the journal, and names the phase it is in.
  - "Phases: queued (a start or restart job waits), stagger (ExecStartPre sleep), starting,
    loading, compiling, warming up, health check (the socket is open, the readiness gate runs),
    ready (active), stopping (a restart stops the old process), restarting (failed, Restart= will
    start it again), failed, inactive."
  - One observation per call; the action plugin of the same name polls it and prints the progress,
    and takes three options of its own, C(timeout_s), C(poll_s) and C(report_s)
    (plugins/action/epd_engine_progress.py).
  - Read-only; supports check mode.
options:
  instances:
    description: Engine instances (ve-0, pd-1, ...).
    type: list
    elements: str
    required: true
author: epd-kit
"""

EXAMPLES = r"""
- name: Wait until every engine is ready, printing each phase change (the action plugin polls)
  epd.kit.epd_engine_progress:
    instances: [ve-0, pd-0, pd-1]
    timeout_s: 600
    poll_s: 2
"""

RETURN = r"""
engines:
  description: One entry per instance, in the given order.
  type: list
  elements: dict
  returned: always
  sample: [{"instance": "pd-0", "unit": "epd-engine@pd-0.service", "phase": "compiling", "done": false,
            "active_state": "activating", "sub_state": "start", "elapsed_s": 312.4,
            "last_line": "Compiling the model for Neuron ..."}]
"""

import re
import subprocess
import time

from ansible.module_utils.basic import AnsibleModule

# The log decides the phase while systemd only says "activating": the newest line that matches
# wins, the patterns are tried in this order (vLLM's and epd-sim's wording).
LOG_PHASES = (
    ("health check", re.compile(r"Uvicorn running on|Application startup complete")),
    ("warming up", re.compile(r"[Ww]arm(ing)?[ -]?up|Compilation finished|[Cc]ompil\w* (is )?(done|complete)")),
    ("compiling", re.compile(r"[Cc]ompil")),
    ("loading", re.compile(r"[Ll]oad(ing)? (the )?(model|weights|checkpoint)|Starting to load|[Ll]oading safetensors")),
)
TERMINAL = frozenset({"ready", "failed", "inactive"})
SHOW = ("ActiveState", "SubState", "InactiveExitTimestampMonotonic", "ActiveEnterTimestampMonotonic")


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout


def _unit_state(unit: str) -> dict[str, str]:
    out = _run(["systemctl", "show", unit, *(f"--property={p}" for p in SHOW)])
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _log_lines(unit: str, since_epoch_s: float) -> list[str]:
    out = _run(
        [
            "journalctl",
            "--no-pager",
            "--quiet",
            "--output=cat",
            "--lines=200",
            f"--unit={unit}",
            f"--since=@{int(since_epoch_s)}",
        ]
    )
    return [line for line in out.splitlines() if line.strip()]


def log_phase(lines: list[str]) -> tuple[str | None, str]:
    """The phase named by the newest matching line, and that line."""
    for line in reversed(lines):
        for phase, pattern in LOG_PHASES:
            if pattern.search(line):
                return phase, line
    return None, lines[-1] if lines else ""


def observe(instance: str, job: str | None, now_monotonic_us: int) -> dict:
    """One engine's phase; `job` is the state of its queued systemd job, if any. A unit with a
    job is never done: after `restart --no-block` it is still `active` until the job runs."""
    unit = f"epd-engine@{instance}.service"
    state = _unit_state(unit)
    active, sub = state.get("ActiveState", "unknown"), state.get("SubState", "unknown")
    started_us = int(state.get("InactiveExitTimestampMonotonic") or 0)
    entered_us = int(state.get("ActiveEnterTimestampMonotonic") or 0)
    end_us = entered_us if active == "active" and entered_us >= started_us else now_monotonic_us
    elapsed_s = round((end_us - started_us) / 1e6, 1) if started_us else 0.0
    last_line = ""
    if job == "waiting":
        phase, elapsed_s = "queued", 0.0  # the timestamps still describe the previous start
    elif active == "deactivating" or (job and active == "active"):
        phase, elapsed_s = "stopping", 0.0
    elif active == "active":
        phase = "ready"
    elif active in ("failed", "inactive"):
        phase = active
    elif sub == "auto-restart":
        phase = "restarting"
    elif sub == "start-pre":
        phase = "stagger"
    else:
        since = time.time() - (now_monotonic_us - started_us) / 1e6 if started_us else time.time()
        found, last_line = log_phase(_log_lines(unit, since - 1))
        phase = "health check" if sub == "start-post" and found in (None, "health check") else (found or "starting")
    return {
        "instance": instance,
        "unit": unit,
        "phase": phase,
        "done": phase in TERMINAL and job is None,
        "active_state": active,
        "sub_state": sub,
        "elapsed_s": elapsed_s,
        "last_line": last_line[-300:],
    }


def unit_jobs(units: list[str]) -> dict[str, str]:
    """unit -> state (waiting | running) of its queued job (`systemctl list-jobs`: JOB UNIT TYPE STATE)."""
    out = _run(["systemctl", "list-jobs", "--no-legend", "--plain", *units]) if units else ""
    rows = [line.split() for line in out.splitlines()]
    return {row[1]: row[3] for row in rows if len(row) >= 4}


def main() -> None:
    module = AnsibleModule(
        argument_spec={"instances": {"type": "list", "elements": "str", "required": True}}, supports_check_mode=True
    )
    instances = module.params["instances"]
    jobs = unit_jobs([f"epd-engine@{i}.service" for i in instances])
    now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    engines = [observe(i, jobs.get(f"epd-engine@{i}.service"), now_us) for i in instances]
    module.exit_json(changed=False, engines=engines)


if __name__ == "__main__":
    main()
