"""Action plugin epd.kit.epd_engine_progress: wait until the host's engines are ready (or failed),
printing each engine's phase as it changes, and end with a summary of the slowest engines.

It runs the module of the same name (one observation on the host) every `poll_s` seconds, for at
most `timeout_s`. Progress goes to the controller's output while the task runs (an Ansible task
otherwise shows nothing until it ends, and a Neuron compile takes minutes):

    [n1] pd-0: compiling (35 s)  Compiling the model for Neuron ...
    [n1] waiting: pd-0 compiling 65 s, ve-0 warming up 61 s

Options: instances (list), timeout_s (int), poll_s (int, default 5), report_s (int, default 60:
the interval of the "waiting" line), slowest (int, default 3: engines named in the summary).
Returns engines (the module's last observation), timed_out, summary (lines).
"""

from __future__ import annotations

import time

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()
MODULE = "epd.kit.epd_engine_progress"


def _seconds(value: float) -> str:
    minutes, seconds = divmod(int(value), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds} s"


def summary(engines: list[dict], slowest: int, timed_out: bool) -> list[str]:
    """Every engine's final phase and time, slowest first; the first `slowest` marked."""
    ordered = sorted(engines, key=lambda e: e["elapsed_s"], reverse=True)
    lines = [f"{e['instance']}: {e['phase']} after {_seconds(e['elapsed_s'])}" for e in ordered]
    if ordered:
        names = ", ".join(f"{e['instance']} {_seconds(e['elapsed_s'])}" for e in ordered[:slowest])
        lines.append(f"slowest: {names}")
    if timed_out:
        lines.append("timed out waiting: " + ", ".join(e["instance"] for e in engines if not e["done"]))
    return lines


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset({"instances", "timeout_s", "poll_s", "report_s", "slowest"})

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        instances = [str(i) for i in args.get("instances") or []]
        timeout_s = float(args.get("timeout_s", 3600))
        poll_s = max(float(args.get("poll_s", 5)), 0.5)
        report_s = float(args.get("report_s", 60))
        slowest = int(args.get("slowest", 3))
        # the engine's host: the delegated one when a play on the router hosts rolls engines
        host = self._task.delegate_to or (task_vars or {}).get("inventory_hostname", "?")

        deadline = time.monotonic() + timeout_s
        last_report = time.monotonic()
        shown: dict[str, str] = {}
        engines: list[dict] = []
        while instances:
            observed = self._execute_module(
                module_name=MODULE, module_args={"instances": instances}, task_vars=task_vars
            )
            if observed.get("failed"):
                return {**result, **observed}
            engines = observed["engines"]
            for engine in engines:
                if shown.get(engine["instance"]) != engine["phase"]:
                    shown[engine["instance"]] = engine["phase"]
                    line = f"  {engine['last_line']}" if engine["last_line"] else ""
                    elapsed = _seconds(engine["elapsed_s"])
                    display.display(f"[{host}] {engine['instance']}: {engine['phase']} ({elapsed}){line}")
            waiting = [e for e in engines if not e["done"]]
            if not waiting or time.monotonic() >= deadline:
                break
            if time.monotonic() - last_report >= report_s:
                last_report = time.monotonic()
                display.display(
                    f"[{host}] waiting: "
                    + ", ".join(f"{e['instance']} {e['phase']} {_seconds(e['elapsed_s'])}" for e in waiting)
                )
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0)))

        timed_out = any(not e["done"] for e in engines)
        result.update(changed=False, engines=engines, timed_out=timed_out, summary=summary(engines, slowest, timed_out))
        return result
