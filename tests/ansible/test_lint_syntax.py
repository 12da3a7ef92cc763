"""ansible-lint (production profile) and --syntax-check of every playbook."""
from __future__ import annotations

import pytest

from tests.ansible.helpers import BIN, REPO, playbook, run

pytestmark = pytest.mark.ansible

PLAYBOOKS = sorted(p.name for p in (REPO / "playbooks").glob("*.yml"))


def test_every_planned_playbook_exists():
    expected = {"deploy.yml", "plan.yml", "render.yml", "start.yml", "stop.yml", "restart.yml",
                "status.yml", "rolling_restart.yml", "teardown.yml"}
    assert expected <= set(PLAYBOOKS)


def test_ansible_lint_production_profile_is_clean():
    result = run([str(BIN / "ansible-lint"), "--profile", "production", "roles", "playbooks", "inventory"], timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in result.stderr + result.stdout


@pytest.mark.parametrize("name", PLAYBOOKS)
def test_syntax_check(name):
    result = playbook("-i", "inventory/examples/multi-node", "--syntax-check", f"playbooks/{name}")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_role_has_argument_specs_matching_its_defaults():
    import yaml

    for role in sorted((REPO / "roles").iterdir()):
        spec_file = role / "meta/argument_specs.yml"
        assert spec_file.exists(), f"{role.name} has no meta/argument_specs.yml"
        specs = yaml.safe_load(spec_file.read_text())["argument_specs"]
        assert "main" in specs, f"{role.name}: no 'main' entry point"
        defaults_file = role / "defaults/main.yml"
        defaults = yaml.safe_load(defaults_file.read_text()) if defaults_file.exists() else {}
        options = specs["main"].get("options", {})
        for name, option in options.items():
            assert option.get("description"), f"{role.name}: {name} has no description"
            assert option.get("type"), f"{role.name}: {name} has no type"
        missing = set(defaults or {}) - set(options)
        assert not missing, f"{role.name}: defaults without a spec entry: {sorted(missing)}"
        for name, value in (defaults or {}).items():
            if isinstance(value, str) and "{{" in value:
                continue  # templated defaults are documented, not compared
            assert options[name].get("default") == value, f"{role.name}: spec default of {name} differs from defaults/main.yml"


def test_argument_specs_accept_their_defaults(tmp_path):
    """Ansible's own validator (what runs at role start) accepts every role's defaults."""
    import yaml

    plays = []
    for role in sorted((REPO / "roles").iterdir()):
        defaults_file = role / "defaults/main.yml"
        if not defaults_file.exists():
            continue
        plays.append({
            "name": f"validate {role.name}",
            "hosts": "localhost",
            "gather_facts": False,
            "vars_files": [str(defaults_file)],
            "vars": {"role_path": str(role), "epd_deps_repo_dir": str(REPO)},
            "tasks": [{
                "name": f"Validate {role.name} defaults",
                "ansible.builtin.validate_argument_spec": {
                    "argument_spec": yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"],
                },
            }],
        })
    book = tmp_path / "validate.yml"
    book.write_text(yaml.safe_dump(plays, sort_keys=False))
    result = playbook(str(book))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert result.stdout.count("Validate epd_") == len(plays)


def test_inventory_model_specs_match_the_planner_defaults():
    """The inventory variables' defaults live in the planner; the spec documents the same values."""
    import yaml

    from epd_kit import plan as planner

    options = yaml.safe_load((REPO / "roles/epd_preflight/meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    for name, value in {**planner.GLOBAL_DEFAULTS, **planner.HOST_DEFAULTS}.items():
        assert name in options, f"planner variable {name} has no entry in epd_preflight's argument_specs"
        if value is not None:
            assert options[name].get("default") == value, f"{name}: spec default {options[name].get('default')!r} != planner {value!r}"
