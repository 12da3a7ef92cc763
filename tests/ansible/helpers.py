"""Tier 2 helpers: run real ansible-playbook / ansible-inventory from the repository root."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.budget import scaled

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# an inventory host that is this machine, run by this venv's Python (how the roles' checks are
# tested without a host)
LOCAL_HOST = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
INVENTORIES = sorted(
    [p for p in (REPO / "inventory/examples").iterdir() if (p / "hosts.yml").exists()]
    + [p for p in (REPO / "inventory/sandbox").iterdir() if (p / "hosts.yml").exists()]
)
INVENTORY_IDS = [f"{p.parent.name}/{p.name}" for p in INVENTORIES]


def ansible_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_LOCAL_TEMP": str(Path(os.environ.get("TMPDIR", "/tmp")) / "epd-ansible-tmp"),
            "PATH": f"{BIN}:{env.get('PATH', '')}",
        }
    )
    env.pop("HF_TOKEN", None)
    env.update(extra)
    return env


def run(argv: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    """`argv` from the repository root; `timeout` is a quiet machine's budget, scaled (tests/budget.py)."""
    return subprocess.run(
        argv, cwd=REPO, env=ansible_env(**env), capture_output=True, text=True, timeout=scaled(timeout), check=False
    )


def playbook(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return run([str(BIN / "ansible-playbook"), *args], timeout=timeout, **env)


def _local_run(
    tmp_path: Path, tasks: list[dict[str, Any]], registered: list[str]
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`tasks` and a last one that saves the results registered under `registered` to a JSON file:
    (the run, that file)."""
    out = tmp_path / "registered.json"
    content = "{{ {" + ", ".join(f"'{name}': {name}" for name in registered) + "} | to_json }}"
    save = {"name": "Save the registered results", "ansible.builtin.copy": {"content": content, "dest": str(out)}}
    play = {
        "hosts": "localhost",
        "connection": "local",
        "gather_facts": False,
        "vars": {"ansible_python_interpreter": sys.executable},
        "tasks": [*tasks, save],
    }
    book = tmp_path / "play.yml"
    book.write_text(yaml.safe_dump([play], sort_keys=False))
    return playbook(str(book)), out


def local_play(tmp_path: Path, tasks: list[dict[str, Any]], registered: list[str]) -> dict[str, Any]:
    """`tasks` through ansible-playbook on localhost with this venv's Python (how the kit's own
    modules are tested without a host); returns the results the tasks registered under the
    names in `registered`."""
    result, out = _local_run(tmp_path, tasks, registered)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    return json.loads(out.read_text())


def local_plays(tmp_path: Path, cases: dict[str, tuple[list[dict[str, Any]], list[str]]]) -> dict[str, dict[str, Any]]:
    """Several cases' local_play tasks in one ansible-playbook run (a run costs ~2-4 CPU-s however
    few its tasks), in the order given: case -> its registered results under its own names (in the
    run each case's register names carry the case's as a prefix). When that run fails, each case
    runs alone, so a failure names its own case."""
    tasks, registered = [], []
    for case, (case_tasks, names) in cases.items():
        tasks += [{**t, "register": f"{case}__{t['register']}"} if "register" in t else t for t in case_tasks]
        registered += [f"{case}__{name}" for name in names]
    result, out = _local_run(tmp_path, tasks, registered)
    if result.returncode != 0:
        return _Alone({case: _alone(tmp_path / f"alone-{case}", *cases[case]) for case in cases})
    results = json.loads(out.read_text())
    return {case: {name: results[f"{case}__{name}"] for name in names} for case, (_, names) in cases.items()}


def _alone(tmp_path: Path, tasks: list[dict[str, Any]], registered: list[str]) -> dict[str, Any] | AssertionError:
    tmp_path.mkdir()
    try:
        return local_play(tmp_path, tasks, registered)
    except AssertionError as failure:
        return failure


class _Alone(dict):
    """local_plays' cases run alone: a case that failed raises its own failure when read."""

    def __getitem__(self, case: str) -> dict[str, Any]:
        value = super().__getitem__(case)
        if isinstance(value, AssertionError):
            raise value
        return value


def inventory_hostvars(inventory: Path) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """(hostvars, groups) of an inventory, as ansible-inventory resolves them. The repository's own
    inventories (inventory/) are read once per pytest process, each caller getting a copy of its
    own: one ansible-inventory run is ~1.5 CPU-s, and the host-free lane's tests read the same ones
    from several modules (test_render, test_render_checkable, test_observability_config, unit/plan)."""
    resolved = Path(inventory).resolve()
    if resolved.is_relative_to(REPO / "inventory"):
        return copy.deepcopy(_repository_inventory(resolved))
    return _read_inventory(inventory)


@functools.cache
def _repository_inventory(inventory: Path) -> tuple[dict[str, Any], dict[str, list[str]]]:
    return _read_inventory(inventory)


def _read_inventory(inventory: Path) -> tuple[dict[str, Any], dict[str, list[str]]]:
    result = run([str(BIN / "ansible-inventory"), "-i", str(inventory), "--list"])
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    hostvars = data["_meta"]["hostvars"]
    groups: dict[str, list[str]] = {}

    def hosts_of(group: str) -> list[str]:
        entry = data.get(group, {})
        out = list(entry.get("hosts", []))
        for child in entry.get("children", []):
            out += [h for h in hosts_of(child) if h not in out]
        return out

    for group in ("epd_engines", "epd_router"):
        groups[group] = hosts_of(group)
    return hostvars, groups


def host_output(output: str, host: str) -> str:
    """What an ansible-playbook run printed about one host of several (tests that batch their cases
    as hosts of one run read their own host's here): each result block whose header names it
    (`fatal: [h1]: ...` and its indented lines) and each line that starts with `h1: ` (the inventory
    check's problems, one a line)."""
    picked: list[str] = []
    mine = False
    for line in output.splitlines():
        if line and not line[0].isspace():  # a header: a task, a play, or a host's result
            mine = f"[{host}]" in line or f"[{host} ->" in line
        if mine or line.strip().startswith(f"{host}: "):
            picked.append(line)
    return "\n".join(picked)
