"""ansible-lint (production profile) and --syntax-check of every playbook."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.ansible.helpers import BIN, REPO, playbook, run

pytestmark = pytest.mark.ansible

PLAYBOOKS = sorted(p.name for p in (REPO / "playbooks").glob("*.yml"))


def test_every_planned_playbook_exists():
    expected = {
        "deploy.yml",
        "plan.yml",
        "render.yml",
        "start.yml",
        "stop.yml",
        "restart.yml",
        "status.yml",
        "rolling_restart.yml",
        "teardown.yml",
    }
    assert expected <= set(PLAYBOOKS)


def test_ansible_lint_production_profile_is_clean():
    """The whole collection (galaxy.yml, roles, playbooks, plugins, inventories), as Galaxy would see it."""
    result = run([str(BIN / "ansible-lint")], timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in result.stderr + result.stdout


def test_syntax_check_of_every_playbook():
    """One ansible-playbook run checks them all (a run costs about a CPU-second before it reads a
    playbook); it names each playbook it checked, and stops at the first that fails, naming it."""
    paths = [f"playbooks/{name}" for name in PLAYBOOKS]
    result = playbook("-i", "inventory/examples/multi-node", "--syntax-check", *paths)
    assert result.returncode == 0, result.stdout + result.stderr
    checked = re.findall(r"^playbook: (\S+)$", result.stdout, re.MULTILINE)
    assert checked == paths, result.stdout


def role_entry_points(role: Path) -> dict[str, dict]:
    import yaml

    return yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]


def test_every_entry_point_has_its_tasks_and_documented_options():
    for role in sorted((REPO / "roles").iterdir()):
        assert (role / "meta/argument_specs.yml").exists(), f"{role.name} has no meta/argument_specs.yml"
        for entry, spec in role_entry_points(role).items():
            assert (role / f"tasks/{entry}.yml").exists(), f"{role.name}: entry point {entry} has no tasks/{entry}.yml"
            assert spec.get("short_description"), f"{role.name}.{entry} has no short_description"
            for name, option in (spec.get("options") or {}).items():
                assert option.get("description"), f"{role.name}.{entry}: {name} has no description"
                assert option.get("type"), f"{role.name}.{entry}: {name} has no type"


def test_entry_points_called_by_the_playbooks_are_declared():
    """tasks_from: X is validated against entry point X (only X, never "X.yml", names one)."""
    declared = {f"epd.kit.{role.name}": set(role_entry_points(role)) for role in (REPO / "roles").iterdir()}
    assert declared["epd.kit.epd_preflight"] >= {"controller", "host"}
    assert "plan" in declared["epd.kit.epd_common"]
    for path in sorted([*(REPO / "playbooks").rglob("*.yml"), *(REPO / "roles").rglob("tasks/*.yml")]):
        text = path.read_text()
        assert not re.search(r"tasks_from: \S+\.yml", text), (
            f"{path}: tasks_from X.yml skips entry point X's argument spec"
        )
        for role, entry in re.findall(r"name: (epd\.kit\.\w+)\n\s+tasks_from: (\w+)", text):
            if entry in ("controller", "host", "plan"):
                assert entry in declared[role], f"{path}: {role} tasks_from {entry} is not a declared entry point"


def test_role_defaults_are_specified_with_the_same_values():
    import yaml

    for role in sorted((REPO / "roles").iterdir()):
        defaults_file = role / "defaults/main.yml"
        defaults = (yaml.safe_load(defaults_file.read_text()) if defaults_file.exists() else None) or {}
        options: dict = {}
        for spec in role_entry_points(role).values():
            options.update(spec.get("options") or {})
        missing = set(defaults) - set(options)
        assert not missing, f"{role.name}: defaults without a spec entry: {sorted(missing)}"
        for name, value in defaults.items():
            assert options[name].get("default") == value, (
                f"{role.name}: spec default of {name} differs from defaults/main.yml"
            )


def test_argument_specs_accept_their_defaults(tmp_path):
    """Ansible's own validator (what runs at role start) accepts every entry point's defaults."""
    import yaml

    def variable_files(role: Path) -> list[str]:
        """What the role sees at its start: its dependencies' defaults and vars, then its own."""
        meta = yaml.safe_load((role / "meta/main.yml").read_text()) or {}
        names = [d["role"].rsplit(".", 1)[-1] for d in meta.get("dependencies") or []] + [role.name]
        files = [REPO / "roles" / name / part for name in names for part in ("defaults/main.yml", "vars/main.yml")]
        return [str(f) for f in files if f.exists()]

    plays = []
    for role in sorted((REPO / "roles").iterdir()):
        for entry, spec in role_entry_points(role).items():
            plays.append(
                {
                    "name": f"validate {role.name} {entry}",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "vars_files": variable_files(role),
                    "vars": {"role_path": str(role)},
                    "tasks": [
                        {
                            "name": f"Validate {role.name} {entry} defaults",
                            "ansible.builtin.validate_argument_spec": {"argument_spec": spec.get("options") or {}},
                        }
                    ],
                }
            )
    book = tmp_path / "validate.yml"
    book.write_text(yaml.safe_dump(plays, sort_keys=False))
    result = playbook(str(book))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert result.stdout.count("Validate epd_") == len(plays)


def test_inventory_model_specs_match_the_planner_defaults():
    """The inventory variables' defaults live in the planner; epd_common's plan spec has the same values and types."""
    from epd_kit import plan as planner

    options = role_entry_points(REPO / "roles/epd_common")["plan"]["options"]
    types = {bool: "bool", int: "int", str: "str", list: "list", dict: "dict"}
    for name, value in {**planner.GLOBAL_DEFAULTS, **planner.HOST_DEFAULTS}.items():
        assert name in options, f"planner variable {name} has no entry in epd_common's plan argument spec"
        if value is not None:
            assert options[name].get("default") == value, (
                f"{name}: spec default {options[name].get('default')!r} != planner {value!r}"
            )
            assert options[name]["type"] == types[type(value)], (
                f"{name}: spec type {options[name]['type']} for {value!r}"
            )
    model_options = {
        n
        for n in options
        if n.startswith("epd_") and n not in ("epd_plan_faulted", "epd_common_replan", "epd_common_inventory_only")
    }
    assert model_options == set(planner.GLOBAL_DEFAULTS) | set(planner.HOST_DEFAULTS), (
        "spec lists a variable the planner does not read"
    )


def test_architecture_inventory_table_shows_the_planner_defaults():
    """docs/architecture.md's inventory table: every planner variable, with the planner's default."""
    from epd_kit import plan as planner

    text = (REPO / "docs/architecture.md").read_text()
    start = text.index("## Inventory model")
    documented: dict[str, str] = {}
    for line in text[start : text.index("\n## ", start)].splitlines():
        cells = [cell.strip().replace("`", "") for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3:
            continue
        names = re.findall(r"epd_\w+", cells[0])
        defaults = cells[1].split(" / ") if len(names) > 1 and " / " in cells[1] else [cells[1]] * len(names)
        documented.update(zip(names, defaults, strict=False))
    for name, value in {**planner.GLOBAL_DEFAULTS, **planner.HOST_DEFAULTS}.items():
        if name == "epd_model":
            expected = "(required)"
        elif value is None:
            expected = "unset"
        else:
            expected = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
        assert documented.get(name) == expected, (
            f"{name}: docs/architecture.md says {documented.get(name)!r}, the planner {expected!r}"
        )


def _strings(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def test_no_doubled_backslash_reaches_a_jinja_expression():
    """`regex_replace('\\\\.env$', '')` written in a folded (>-) or plain YAML scalar reaches Jinja
    with both backslashes, and under ansible-core 2.19 the pattern then never matches: a deploy
    found no engine to retire and no restart mark to resume. Only a double-quoted YAML string
    halves them. Write such a pattern as '[.]env$' instead."""
    import yaml

    found = [
        f"{path.relative_to(REPO)}: {text.strip()[:100]}"
        for path in sorted([*REPO.glob("roles/**/*.yml"), *REPO.glob("playbooks/**/*.yml")])
        for text in _strings(yaml.safe_load(path.read_text()))
        if "{{" in text and "\\\\" in text
    ]
    assert not found, "\n".join(found)
