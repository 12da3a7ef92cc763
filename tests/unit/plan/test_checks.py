"""The inventory check (epd_kit.plan.checks): docs/planner.md's table of bad inventories, row by row,
then the same check through plan.yml (each problem printed once, no host contacted)."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from epd_kit import plan as planner
from tests import repo_modules
from tests.ansible import helpers

REPO = Path(__file__).resolve().parents[3]
REQUIREMENTS = REPO / "meta/ee-requirements.txt"  # the collection's controller requirements
BASE_GROUP_VARS = {"epd_model": "/models/m"}
BASE_HOST = {"epd_num_ve": 1, "epd_num_pd": 1}
GROUPS = ("epd_engines", "epd_router", "epd_loadbalancer", "epd_monitoring", "epd_precompile")


def bad_inventories(heading: str = "## Bad inventories and their messages") -> list[tuple[str, dict[str, Any], str]]:
    """(name, change, message) of every row of the table under `heading` in docs/planner.md."""
    text = (REPO / "docs/planner.md").read_text()
    start = text.index(heading)
    section = text[start : text.index("\n## ", start + 1)]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`{"):
            rows.append((cells[0], yaml.safe_load(cells[1].strip("`")), cells[2].strip("`")))
    return rows


def inventory(change: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, list[str] | None]]:
    """(hostvars, groups) of the base inventory with `change` applied, as the table says (None: no such group)."""
    group_vars = {**BASE_GROUP_VARS, **(change.get("all") or {})}
    hosts = {"n1": dict(BASE_HOST)}
    for name, values in change.items():
        if name not in ("all", *GROUPS):
            hosts.setdefault(name, {}).update(values or {})
    groups: dict[str, list[str] | None] = {"epd_engines": list(hosts), "epd_router": ["n1"]}
    groups.update({group: change[group] for group in GROUPS if group in change})
    return {name: {**group_vars, **values} for name, values in hosts.items()}, groups


def check(change: dict[str, Any]) -> dict[str, Any]:
    hostvars, groups = inventory(change)
    present = {group: hosts for group, hosts in groups.items() if hosts is not None}
    return planner.check_inventory(hostvars, present, None, repo_modules.filters().known_variables())


ROWS = bad_inventories()


def test_the_docs_table_has_the_bad_inventories():
    assert len(ROWS) >= 15


@pytest.mark.parametrize(("change", "message"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_inventory_is_refused_with_its_message(change, message):
    result = check(change)
    assert result["plan"] is None and result["settings"] is None
    assert any(message in problem for problem in result["problems"]), result["problems"]


# issue 35's table: values checked by their form, the router's settings by the router's own models,
# the cross-setting rules; "(warning)" rows pass and print their message as a warning
SHAPE_ROWS = bad_inventories("## Settings checked by their shape and by each other")


def test_the_docs_table_has_forty_more_mistakes():
    assert len(SHAPE_ROWS) >= 40
    assert not {row[0] for row in SHAPE_ROWS} & {row[0] for row in ROWS}


@pytest.mark.parametrize(("name", "change", "message"), SHAPE_ROWS, ids=[row[0] for row in SHAPE_ROWS])
def test_a_setting_of_the_wrong_shape_or_against_another_is_refused_before_any_host(name, change, message):
    result = check(change)
    if name.endswith("(warning)"):
        assert result["problems"] == [] and result["plan"] is not None, result["problems"]
        assert any(message.removeprefix("WARNING: ") in warning for warning in result["warnings"]), result["warnings"]
    else:
        assert result["plan"] is None and result["settings"] is None
        assert any(message in problem for problem in result["problems"]), result["problems"]


def test_every_cross_setting_rule_is_documented_with_its_reason():
    text = (REPO / "docs/planner.md").read_text()
    for rule in planner.rules.RULES:
        assert f"`{rule.name}`" in text, f"docs/planner.md does not list the rule {rule.name}"
        assert rule.reason


def promised_rules(doc: str) -> list[str]:
    """The rule names in the first column of every `| rule | ... |` table of docs/<doc>."""
    names, in_table = [], False
    for line in (REPO / "docs" / doc).read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells and cells[0] == "rule":
            in_table = True
        elif not cells:
            in_table = False
        elif in_table and cells[0].startswith("`"):
            names.append(cells[0].strip("`"))
    return names


@functools.cache
def row_results() -> dict[str, dict[str, Any]]:
    """The check's result for every row of docs/planner.md's two tables, once."""
    return {row[0]: check(row[1]) for row in SHAPE_ROWS + ROWS}


PROMISED = [(doc, name) for doc in ("operations.md", "security.md") for name in promised_rules(doc)]


def test_the_operations_and_security_docs_promise_rules():
    assert {doc for doc, _ in PROMISED} == {"operations.md", "security.md"} and len(PROMISED) >= 8


@pytest.mark.parametrize(("doc", "name"), PROMISED, ids=[f"{doc}:{name}" for doc, name in PROMISED])
def test_every_rule_the_docs_promise_is_a_rule_of_the_code_with_a_case_that_triggers_it(doc, name):
    """A promise in docs/operations.md or docs/security.md is a registered rule, and one of
    docs/planner.md's rows (each a test case above) meets it with the rule's own bracketed reason."""
    rules = {rule.name: rule for rule in planner.rules.RULES}
    assert name in rules, f"docs/{doc} promises the rule {name}, which epd_kit/plan/rules.py does not have"
    lines = "warnings" if rules[name].warning else "problems"
    met = [row for row, result in row_results().items() if any(f"[{name}: " in line for line in result[lines])]
    assert met, f"no row of docs/planner.md's tables triggers {name}"


@pytest.mark.parametrize(
    ("value", "text_only"), [("true", True), ("yes", True), ("True", True), ("false", False), ("no", False)]
)
def test_ini_strings_for_booleans_read_as_ansible_bool(value, text_only):
    """An INI inventory passes epd_text_only=true as the string 'true' (docs/planner.md "INI inventories")."""
    result = check({"all": {"epd_text_only": value}, "n1": {"epd_num_ve": 0 if text_only else 1}})
    assert result["problems"] == [], result["problems"]


def test_ini_strings_for_numbers_pass():
    change = {"all": {"epd_router_workers": "2", "epd_observability_error_ratio": "0.1", "epd_haproxy_port": "8080"}}
    assert check(change)["problems"] == []


def test_the_kit_defaults_warn_about_nothing():
    change = {"epd_loadbalancer": ["n1"]}
    result = check(change)
    assert result["problems"] == [] and result["warnings"] == []


def test_an_inventory_only_check_needs_no_model_or_router():
    """provision.yml and teardown.yml check the variables without planning (epd_common_inventory_only)."""
    hostvars = {"n1": {"epd_provision_efa_installer_sha256": "abc"}}
    result = planner.check_inventory(
        hostvars, {"epd_engines": ["n1"]}, None, repo_modules.filters().known_variables(), plan_fleet=False
    )
    assert result["problems"] == [
        "n1: epd_provision_efa_installer_sha256 is 'abc': write 64 lowercase hex digits (sha256sum's output)"
    ]
    hostvars = {"n1": {"epd_provision_neuron_driver_version": "2.30.2.0"}}
    result = planner.check_inventory(
        hostvars, {"epd_engines": ["n1"]}, None, repo_modules.filters().known_variables(), plan_fleet=False
    )
    assert result == {"problems": [], "warnings": [], "plan": None, "settings": None}


def test_without_the_router_package_the_router_settings_are_checked_by_kind_and_a_warning_says_so(monkeypatch):
    """A controller Python that cannot load router_yaml (no pydantic): kinds only, and the warning
    names the cause and the command (tests/unit/plan/test_planner.py runs it without pydantic)."""
    monkeypatch.setattr(planner.router_check, "_load", lambda: (None, "No module named 'pydantic'"))
    result = check({"all": {"epd_router_health": {"failure_ratio": 1.5}}})
    assert result["problems"] == []
    assert any("checked by kind only" in warning for warning in result["warnings"]), result["warnings"]
    assert any(
        "(No module named 'pydantic')" in warning and warning.endswith("-m pip install -r " + str(REQUIREMENTS))
        for warning in result["warnings"]
    ), result["warnings"]
    # an installed wheel has no collection beside it: the command names pydantic itself
    monkeypatch.setattr(planner.router_check, "CONTROLLER_REQUIREMENTS", REPO / "no-such-requirements.txt")
    assert planner.router_check.install_command() == f"{sys.executable} -m pip install pydantic"


def test_the_base_inventory_passes_and_plans():
    result = check({})
    assert result["problems"] == []
    assert [e["engine_id"] for e in result["plan"]["n1"]["engines"]] == ["epd-pd-0", "epd-ve-0"]
    assert result["settings"]["epd_model"] == "/models/m"


@pytest.mark.parametrize("value", [True, "yes"])
def test_a_text_only_fleet_passes_and_its_router_config_says_so_to_the_router(value):
    """The check's settings carry epd_text_only as it read it (INI text included); the render writes
    it into endpoints, and only then does the router's own schema take the empty VE list."""
    from epd_kit.router_yaml import ConfigError, parse_config

    result = check({"all": {"epd_text_only": value}, "n1": {"epd_num_ve": 0}})
    assert result["problems"] == [] and result["settings"]["epd_text_only"] is True
    settings = planner.read_settings(result["settings"])
    config = planner.router_config(result["plan"], settings, listen_host="127.0.0.1", text_only=True)
    endpoints = config["models"][0]["endpoints"]
    assert endpoints["text_only"] is True and endpoints["ve"] == []
    assert parse_config(config).endpoints.text_only
    with pytest.raises(
        ConfigError, match=re.escape("models.0.endpoints.ve: empty: list at least one VE, or set endpoints.text_only")
    ):
        parse_config(planner.router_config(result["plan"], settings, listen_host="127.0.0.1"))
    assert check({})["settings"]["epd_text_only"] is False


def test_every_problem_is_listed_once():
    problems = check({"all": {"epd_num_pds": 3}, "n1": {"epd_ve_tp_size": 2}, "n2": {}, "epd_router": None})["problems"]
    assert problems == [
        "no router host: add a host to the epd_router group (on one machine, the engine host itself)",
        "n1, n2: unknown variable epd_num_pds; did you mean epd_num_pd?",
        "n1: unknown variable epd_ve_tp_size; did you mean epd_ve_tp?",
    ]


def test_a_replan_skips_the_unknown_variable_check():
    """After the host preflight read facts, hostvars hold the kit's own facts (e.g. epd_neuron)."""
    hostvars, groups = inventory({"n1": {"epd_neuron": {"faulted_cores": []}}})
    assert planner.check_inventory(hostvars, groups, None, None)["problems"] == []


def test_known_variables_cover_the_planner_and_the_check():
    """The planner's variables come from epd_common's plan spec; the check's own from epd_preflight's."""
    known = repo_modules.filters().known_variables()
    assert {*planner.GLOBAL_DEFAULTS, *planner.HOST_DEFAULTS, *planner.CHECK_DEFAULTS} <= known
    assert {"epd_router_api_key", "epd_rr_drain_timeout_s", "epd_engines_stop_timeout_s"} <= known
    controller = yaml.safe_load((REPO / "roles/epd_preflight/meta/argument_specs.yml").read_text())
    options = controller["argument_specs"]["controller"]["options"]
    assert {name: options[name]["default"] for name in planner.CHECK_DEFAULTS} == planner.CHECK_DEFAULTS


# --------------------------------------------------------------------------- plan.yml (real ansible-playbook)


@pytest.mark.ansible
def test_plan_playbook_prints_each_problem_once_and_contacts_no_host(tmp_path):
    # n1 is a documentation address: any attempt to reach it would show up as n1 in the recap
    (tmp_path / "hosts.yml").write_text(
        yaml.safe_dump(
            {
                "all": {
                    "vars": {**BASE_GROUP_VARS, "epd_num_pds": 3},
                    "children": {
                        "epd_engines": {"hosts": {"n1": {"ansible_host": "192.0.2.1", **BASE_HOST}}},
                        "epd_router": {"hosts": {"n1": None}},
                    },
                }
            }
        )
    )
    result = helpers.playbook("-i", str(tmp_path / "hosts.yml"), "playbooks/plan.yml", timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert output.count("unknown variable epd_num_pds; did you mean epd_num_pd?") == 1, output
    assert "the inventory check found 1 problem(s), listed above" in output
    recap = output[output.index("PLAY RECAP") :]
    assert re.findall(r"^(\S+)\s+:", recap, re.MULTILINE) == ["localhost"], recap
    assert "UNREACHABLE" not in output


def test_the_default_start_timeout_covers_compile_budget_stagger_and_margin():
    """Unset, each host's TimeoutStartSec is derived from its own engines (another host's change leaves it)."""
    result = check(
        {
            "all": {"epd_start_stagger_s": 30, "epd_client_networks": ["10.0.0.0/16"]},
            "n1": {"epd_num_pd": 3, "epd_bind_address": "10.0.0.1"},
            "n2": {"epd_num_pd": 2, "epd_bind_address": "10.0.0.2"},
        }
    )
    assert result["problems"] == []
    last_delay = {
        host: max(e["start_delay_s"] for e in host_plan["engines"]) for host, host_plan in result["plan"].items()
    }
    assert last_delay == {"n1": 90, "n2": 30}
    for host, host_plan in result["plan"].items():
        assert host_plan["start_timeout_s"] == 6000 + last_delay[host] + planner.START_MARGIN_S


def test_a_start_timeout_that_covers_the_budget_is_kept():
    assert check({"all": {"epd_start_timeout_s": 6010}})["plan"]["n1"]["start_timeout_s"] == 6010
