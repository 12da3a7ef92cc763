"""epd.kit.epd_units, the module that enables and starts a role's units in one module run, through
real ansible-playbook on this machine against a stand-in `systemctl` (no systemd runs here; the
e2e tier runs the module against real systemd in every deploy): one call per verb, only the units
that need it, nothing in check mode, a failed unit reset before its start, and a unit systemd does
not know fails with systemctl's words."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.ansible.helpers import local_play

pytestmark = pytest.mark.ansible

# the answers of systemd 252 (Debian 12) for the verbs the module uses, as systemctl(1) gives
# them and a test host showed them: is-enabled and is-active print a state per unit and exit 0
# as soon as ANY unit is enabled (active); a unit that does not exist (not in the state file)
# prints nothing for is-enabled, an error on stderr, and makes it exit 1
FAKE_SYSTEMCTL = """#!{python}
import json, sys
state_file, log_file = {state!r}, {log!r}
units = json.load(open(state_file))
args = [a for a in sys.argv[1:] if a != "--"]
with open(log_file, "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
verb, names = args[0], [a for a in args[1:] if not a.startswith("--")]
if verb == "is-enabled":
    missing = [name for name in names if name not in units]
    for name in names:
        if name in missing:
            print(f"Failed to get unit file state for {{name}}: No such file or directory", file=sys.stderr)
        else:
            print("enabled" if units[name]["enabled"] else "disabled")
    sys.exit(1 if missing or not any(units[n]["enabled"] for n in names) else 0)
if verb == "is-active":
    states = [units[name]["active"] if name in units else "inactive" for name in names]
    for state in states:
        print(state)
    sys.exit(0 if "active" in states else 3)
for name in names:
    unit = units.get(name)
    if verb == "enable":
        if unit is None:
            print(f"Failed to enable unit: Unit file {{name}} does not exist.", file=sys.stderr)
            sys.exit(1)
        unit["enabled"] = True
    elif verb == "reset-failed":
        if unit is not None and unit["active"] == "failed":
            unit["active"] = "inactive"
    elif verb == "start":
        if unit is None:
            print(f"Failed to start {{name}}: Unit {{name}} not found.", file=sys.stderr)
            sys.exit(5)
        if unit["active"] == "failed":  # its start limit hit after a crash loop
            print(f"Job for {{name}} failed. Start request repeated too quickly.", file=sys.stderr)
            sys.exit(1)
        unit["active"] = "activating" if "--no-block" in args else "active"
json.dump(units, open(state_file, "w"))
"""


def fake_systemctl(tmp_path: Path, units: dict) -> tuple[Path, Path, Path]:
    """The stand-in on a PATH directory of its own: (its state file, its call log, the directory)."""
    state, log = tmp_path / "units.json", tmp_path / "calls.log"
    state.write_text(json.dumps(units))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "systemctl"
    fake.write_text(FAKE_SYSTEMCTL.format(python=sys.executable, state=str(state), log=str(log)))
    fake.chmod(0o755)
    return state, log, bin_dir


def test_units_are_enabled_and_started_in_one_call_per_verb_and_only_when_needed(tmp_path: Path):
    state, log, bin_dir = fake_systemctl(
        tmp_path,
        {
            "epd.target": {"enabled": True, "active": "inactive"},
            "epd-engines.target": {"enabled": False, "active": "inactive"},
            "epd-engine@pd-0.service": {"enabled": False, "active": "inactive"},
            "epd-engine@pd-1.service": {"enabled": True, "active": "active"},
        },
    )
    engines = ["epd-engine@pd-0.service", "epd-engine@pd-1.service"]
    units = {"enabled": ["epd.target", "epd-engines.target", *engines], "started": engines, "no_block": True}

    def task(name: str, params: dict, **extra) -> dict:
        return {
            "name": name,
            "epd.kit.epd_units": params,
            "register": name,
            "environment": {"PATH": f"{bin_dir}:/usr/bin:/bin"},
            **extra,
        }

    # the five steps run as one play (an ansible-playbook run is ~2.5 CPU-s, a task ~0.3): a task
    # between two steps writes a line to the call log, which parts it step by step
    step_end = {"name": "Step end", "ansible.builtin.shell": f"echo '[\"step end\"]' >> {log}"}
    steps = [
        task("checked", units, check_mode=True),
        task("applied", units),
        task("again", units),
        task("reached", {"started": ["epd.target"]}),
        # a unit systemd cannot find: is-enabled prints nothing for it, so each unit is asked alone
        task("unknown", {"enabled": ["epd.target", "epd-nope.service"]}, ignore_errors=True),
    ]
    tasks = [t for step in steps for t in (step, step_end)]
    r = local_play(tmp_path, tasks, [step["register"] for step in steps])
    step_calls: list[list[list[str]]] = [[]]
    for line in log.read_text().splitlines():
        call = json.loads(line)
        if call == ["step end"]:
            step_calls.append([])
        else:
            step_calls[-1].append(call)
    assert len(step_calls) == len(steps) + 1 and step_calls[-1] == [], step_calls
    checked, applied, again, reached, unknown = step_calls[:-1]

    assert r["checked"]["changed"] is True
    assert r["checked"]["enabled"] == ["epd-engines.target", "epd-engine@pd-0.service"]
    assert r["checked"]["started"] == ["epd-engine@pd-0.service"]
    # the read calls only, one per verb: is-enabled exited 0 (two units are enabled), and only its
    # lines tell which are not
    assert [call[0] for call in checked] == ["is-enabled", "is-active"]

    assert r["applied"]["changed"] is True
    made = [call for call in applied if call[0] in ("enable", "start")]
    assert made == [
        ["enable", "--", "epd-engines.target", "epd-engine@pd-0.service"],
        ["start", "--no-block", "--", "epd-engine@pd-0.service"],
    ]

    assert r["again"]["changed"] is False and r["again"]["enabled"] == [] and r["again"]["started"] == []
    assert [call[0] for call in again] == ["is-enabled", "is-active"]  # one call per verb, nothing to do

    assert r["reached"]["started"] == ["epd.target"]
    assert reached[-1] == ["start", "--", "epd.target"]  # without no_block: systemctl waits for the job

    assert [call[0] for call in unknown] == ["is-enabled"] * 3 + ["enable"]
    assert r["unknown"]["failed"] is True
    assert "systemctl enable -- epd-nope.service failed (rc 1)" in r["unknown"]["msg"], r["unknown"]
    assert "Unit file epd-nope.service does not exist" in r["unknown"]["msg"], r["unknown"]
    # what "applied" made, left as it was by the steps after it (none of them touches pd-0)
    assert json.loads(state.read_text())["epd-engine@pd-0.service"] == {"enabled": True, "active": "activating"}


def test_a_failed_unit_is_reset_before_its_start(tmp_path: Path):
    """After a crash loop systemd marks the unit failed and refuses a plain start (its start
    limit): a deploy that fixed the cause resets it first, and only it."""
    state, log, bin_dir = fake_systemctl(
        tmp_path,
        {
            "epd-engine@pd-0.service": {"enabled": True, "active": "failed"},
            "epd-engine@ve-0.service": {"enabled": True, "active": "inactive"},
        },
    )
    engines = ["epd-engine@pd-0.service", "epd-engine@ve-0.service"]
    task = {
        "name": "started",
        "epd.kit.epd_units": {"started": engines},
        "register": "started",
        "environment": {"PATH": f"{bin_dir}:/usr/bin:/bin"},
    }
    r = local_play(tmp_path, [task], ["started"])
    assert r["started"]["reset"] == ["epd-engine@pd-0.service"] and r["started"]["started"] == engines
    made = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c for c in made if c[0] in ("reset-failed", "start")] == [
        ["reset-failed", "--", "epd-engine@pd-0.service"],
        ["start", "--", *engines],
    ]
    assert {u["active"] for u in json.loads(state.read_text()).values()} == {"active"}


def test_host_state_reads_what_epd_units_would_do_and_changes_nothing(tmp_path: Path):
    """epd.kit.epd_host_state's unit_changes, the read a role skips its epd_units run on: the same
    two calls (is-enabled, is-active), no enable or start, and the same units epd_units then
    enables and starts; after that the read finds nothing (the skip of a no-op deploy). A failed
    unit counts as one to start (epd_units resets it), an unknown one as one to enable."""
    state, log, bin_dir = fake_systemctl(
        tmp_path,
        {
            "epd.target": {"enabled": True, "active": "active"},
            "epd-engine@pd-0.service": {"enabled": True, "active": "failed"},
            "epd-engine@pd-1.service": {"enabled": False, "active": "active"},
            "epd-engine@ve-0.service": {"enabled": True, "active": "activating"},
        },
    )
    engines = ["epd-engine@pd-0.service", "epd-engine@pd-1.service", "epd-engine@ve-0.service"]
    wanted = {"enabled": ["epd.target", *engines], "started": engines}
    path = {"PATH": f"{bin_dir}:/usr/bin:/bin"}

    def read(name: str, **extra) -> dict:
        return {
            "name": name,
            "epd.kit.epd_host_state": {"unit_changes": wanted},
            "register": name,
            "environment": path,
            **extra,
        }

    def verbs() -> list[str]:
        lines = log.read_text().splitlines()
        log.write_text("")
        return [json.loads(line)[0] for line in lines]

    before = json.loads(state.read_text())
    r = local_play(tmp_path, [read("read")], ["read"])
    assert r["read"]["changed"] is False
    found = r["read"]["unit_changes"]
    assert found == {"enable": ["epd-engine@pd-1.service"], "start": ["epd-engine@pd-0.service"]}
    assert verbs() == ["is-enabled", "is-active"] and json.loads(state.read_text()) == before

    task = {"name": "units", "epd.kit.epd_units": wanted, "register": "units", "environment": path}
    r = local_play(tmp_path, [task, read("again", check_mode=True)], ["units", "again"])
    assert r["units"]["enabled"] == found["enable"] and r["units"]["started"] == found["start"]
    assert r["again"]["unit_changes"] == {"enable": [], "start": []}

    unknown = {**read("unknown"), "epd.kit.epd_host_state": {"unit_changes": {"enabled": ["epd-nope.service"]}}}
    r = local_play(tmp_path, [unknown], ["unknown"])
    assert r["unknown"]["unit_changes"] == {"enable": ["epd-nope.service"], "start": []}
