"""The declaration of every variable (epd_kit/plan/variables.py) against everything that repeats it:
the roles' argument specs and defaults/main.yml, the names the kit's playbooks, tasks and templates
read, the router's config models and its own defaults, the plays that read each role. A failure
names the variable and prints the exact line to add or change in variables.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from epd_kit import plan as planner
from epd_kit.plan import variables as declaration
from epd_kit.plan.hints import nearest
from epd_kit.plan.validate import value_problem
from epd_kit.plan.variables import VARIABLES, Var
from tests import repo_modules

REPO = Path(__file__).resolve().parents[3]
SPEC_TYPES = {
    declaration.STR: "str",
    declaration.PATH: "path",
    declaration.BOOL: "bool",
    declaration.LIST: "list",
    declaration.DICT: "dict",
    declaration.INT: "int",
    declaration.PORT: "int",
    declaration.SECONDS: "int",
    declaration.MILLISECONDS: "int",
    declaration.MINUTES: "int",
    declaration.FLOAT: "float",
    declaration.ANY: "raw",
}
KIND_OF_SPEC_TYPE = {
    "str": "STR",
    "path": "PATH",
    "bool": "BOOL",
    "list": "LIST",
    "dict": "DICT",
    "int": "INT",
    "float": "FLOAT",
    "raw": "ANY",
}
SCOPE_OF_ROLE = {
    "epd_engines": "ENGINE",
    "epd_provision": "ENGINE",
    "epd_router": "ROUTER",
    "epd_haproxy": "LOADBALANCER",
    "epd_observability": "MONITORING",
}


def spec_options() -> dict[str, tuple[str, dict[str, Any]]]:
    """{variable: ("role.entry", option)} of every role entry point's argument spec (first entry wins)."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec_file in sorted(REPO.glob("roles/*/meta/argument_specs.yml")):
        role = spec_file.parts[-3]
        for entry, spec in yaml.safe_load(spec_file.read_text())["argument_specs"].items():
            for name, option in (spec.get("options") or {}).items():
                out.setdefault(name, (f"{role}.{entry}", option))
    return out


def line_to_add(name: str, spec: str | None, option: dict[str, Any] | None) -> str:
    if option is None:
        return f'_v("{name}", <default>, <KIND>, <SCOPE>, plays=(<playbooks that read it>,))'
    role = spec.split(".")[0] if spec else ""
    kind = KIND_OF_SPEC_TYPE[option["type"]]
    if kind == "INT" and name.endswith("_s"):
        kind = "SECONDS"
    extra = f", choices={tuple(option['choices'])!r}" if "choices" in option else ""
    return f'_v("{name}", {option.get("default")!r}, {kind}, {SCOPE_OF_ROLE.get(role, "<SCOPE>")}, "{spec}"{extra})'


def test_every_argument_spec_option_is_declared_with_its_type_and_default():
    problems = []
    for name, (spec, option) in spec_options().items():
        var = VARIABLES.get(name)
        if var is None:
            problems.append(
                f"{name} ({spec}) is not declared: add to router/epd_kit/plan/variables.py: "
                f"{line_to_add(name, spec, option)}"
            )
            continue
        if var.spec != spec:
            problems.append(f"{name}: declared for {var.spec!r}, the argument spec is {spec!r}")
        if SPEC_TYPES.get(var.kind) != option["type"]:
            problems.append(
                f"{name}: declared kind {var.kind} is spec type {SPEC_TYPES.get(var.kind)}, "
                f"the spec says {option['type']}"
            )
        if option.get("default") != var.default:
            problems.append(f"{name}: declared default {var.default!r}, the argument spec's {option.get('default')!r}")
        if tuple(option.get("choices") or ()) != var.choices:
            problems.append(f"{name}: declared choices {var.choices}, the argument spec's {option.get('choices')}")
    declared_specs = {n for n, v in VARIABLES.items() if v.spec}
    for name in sorted(declared_specs - set(spec_options())):
        problems.append(
            f"{name} is declared for {VARIABLES[name].spec} but no argument spec lists it: add it there or drop spec="
        )
    assert not problems, "\n".join(problems)


def test_every_role_default_is_the_declared_default():
    problems = []
    for defaults_file in sorted(REPO.glob("roles/*/defaults/main.yml")):
        for name, value in (yaml.safe_load(defaults_file.read_text()) or {}).items():
            if name not in VARIABLES:
                problems.append(
                    f"{defaults_file.relative_to(REPO)}: {name} is not declared in router/epd_kit/plan/variables.py"
                )
            elif VARIABLES[name].default != value:
                problems.append(
                    f"{defaults_file.relative_to(REPO)}: {name} is {value!r}, "
                    f"declared {VARIABLES[name].default!r}: make them agree"
                )
    assert not problems, "\n".join(problems)


def test_every_name_the_kit_reads_is_declared_and_nothing_else():
    """The names the playbooks, tasks, templates and specs read (the filter plugin's scan) are the declared ones."""
    scanned = repo_modules.filters().known_variables()
    specs = spec_options()
    missing = [
        f"{name}: add to router/epd_kit/plan/variables.py: {line_to_add(name, *specs.get(name, (None, None)))}"
        for name in sorted(scanned - set(VARIABLES))
    ]
    unread = sorted(set(VARIABLES) - scanned)
    assert not missing, "\n".join(missing)
    assert not unread, f"declared but read nowhere in the kit: {unread}; remove them from variables.py"


def _play_text(path: Path, seen: set[Path]) -> str:
    """A playbook with the playbooks and task files it imports or includes."""
    if path in seen or not path.exists():
        return ""
    seen.add(path)
    text = path.read_text()
    for target in re.findall(r"(?:import_playbook|import_tasks|include_tasks):\s*(\S+\.yml)", text):
        text += _play_text(path.parent / target, seen)
    return text


@pytest.mark.parametrize("role", sorted(declaration.ROLE_PLAYS))
def test_each_role_is_read_by_its_declared_plays(role):
    plays = {
        book.stem
        for book in REPO.glob("playbooks/*.yml")
        if re.search(rf"\bepd\.kit\.{role}\b", _play_text(book, set()))
    }
    assert plays == set(declaration.ROLE_PLAYS[role]), f"ROLE_PLAYS[{role!r}] should be {tuple(sorted(plays))}"


def _kind(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return declaration.STR
    args = [a for a in get_args(annotation) if a is not type(None)]
    if args and get_origin(annotation) is not list:
        annotation = args[0]
    if get_origin(annotation) is list or annotation is list:
        return declaration.LIST
    if annotation is Path:
        return declaration.PATH
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):  # a sub-section (listen.tls)
        return declaration.DICT
    return {int: declaration.INT, float: declaration.FLOAT, bool: declaration.BOOL, str: declaration.STR}[annotation]


def test_router_sections_are_the_router_config_models():
    from epd_kit.plan.router_shape import OLD_SHAPE_KEYS
    from epd_kit.router_yaml import RouterConfig

    fields = RouterConfig.model_fields
    for section, keys in declaration.ROUTER_SECTIONS.items():
        model = fields[section].annotation
        actual = {name: _kind(field.annotation) for name, field in model.model_fields.items()}
        assert keys == actual, f"ROUTER_SECTIONS[{section!r}] in variables.py should be {actual}"
    top = set(declaration.ROUTER_SECTIONS) | {key for key in declaration.PLANNED_KEYS if "." not in key}
    # the old shape's keys are planned too (a file of the release before still loads with them)
    assert top == set(fields) | set(OLD_SHAPE_KEYS), f"router.yaml's top-level keys: {sorted(fields)}"
    for key in declaration.PLANNED_KEYS:
        section, _, name = key.partition(".")
        assert not name or name in declaration.ROUTER_SECTIONS[section], key


def test_defaults_the_router_repeats_come_from_the_declaration():
    from epd_kit.preprocess.settings import Limits
    from epd_kit.router import cli
    from epd_kit.router_yaml import Listen

    assert Listen().port == declaration.default("epd_router_port")
    status_url = next(p for p in cli.status.params if p.name == "url")
    assert status_url.default.endswith(f":{declaration.default('epd_router_port')}")
    assert Limits().images_per_prompt == declaration.default("epd_images_per_prompt")
    assert planner.GLOBAL_DEFAULTS["epd_router_port"] == declaration.default("epd_router_port")


def test_every_numeric_default_meets_its_own_bounds():
    for var in VARIABLES.values():
        if isinstance(var.default, (int, float)) and not isinstance(var.default, bool):
            assert value_problem(var, var.default) is None, var.name


def test_durations_are_whole_numbers_and_units_are_refused_with_the_conversion():
    var = VARIABLES["epd_rr_drain_timeout_s"]
    assert value_problem(var, 600) is None and value_problem(var, "600") is None
    assert "write 600" in value_problem(var, "10m")
    assert "write 1.5" in value_problem(var, "1500ms")
    assert "whole number of seconds" in value_problem(var, 1.5)
    assert "write 2" in value_problem(VARIABLES["epd_haproxy_check_inter_ms"], "2ms")
    assert "must be a number without a unit" in value_problem(VARIABLES["epd_observability_ttft_slo_s"], "5s")


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("epd_engines_start_timeout_s", "epd_start_timeout_s"),
        ("epd_engine_start_timeout_s", "epd_start_timeout_s"),
        ("epd_start_timeout", "epd_start_timeout_s"),
        ("epd_router_worker", "epd_router_workers"),
        ("epd_drain_timeout_s", "epd_rr_drain_timeout_s"),
        ("epd_bind_adress", "epd_bind_address"),
        ("epd_num_pds", "epd_num_pd"),
    ],
)
def test_the_hint_names_the_variable_most_likely_meant(typo, meant):
    assert nearest(typo, list(VARIABLES)) == meant


def test_a_name_longer_than_a_file_name_is_refused_before_planning():
    long = "trn2-" + "a" * 283  # 288 characters, as in issue 21
    hostvars = {long: {"epd_model": "/models/m", "epd_num_ve": 1, "epd_num_pd": 1}}
    result = planner.check_inventory(hostvars, {"epd_engines": [long], "epd_router": [long]}, None, set(VARIABLES))
    assert result["plan"] is None
    assert any("the inventory name is 288 bytes, longer than a file name may be (255" in p for p in result["problems"])


def _inventory(directory: Path) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """hostvars and groups of a YAML inventory directory (group_vars/all and per-host variables)."""
    group_vars: dict[str, Any] = {}
    for path in sorted((directory / "group_vars/all").glob("*.yml")):
        group_vars.update(yaml.safe_load(path.read_text()) or {})
    hostvars: dict[str, dict[str, Any]] = {}
    groups: dict[str, list[str]] = {}
    for group, body in yaml.safe_load((directory / "hosts.yml").read_text())["all"]["children"].items():
        groups[group] = []
        for host, values in ((body or {}).get("hosts") or {}).items():
            groups[group].append(host)
            hostvars.setdefault(host, dict(group_vars)).update(values or {})
    return hostvars, groups


@pytest.mark.parametrize("directory", sorted(p.parent for p in REPO.glob("inventory/*/*/hosts.yml")), ids=str)
def test_the_shipped_inventories_pass_the_check(directory):
    hostvars, groups = _inventory(directory)
    result = planner.check_inventory(hostvars, groups, None, set(VARIABLES))
    assert result["problems"] == []


def test_adding_a_variable_is_one_entry():
    """A declared variable is known to the check, validated by kind and scoped, with nothing else to edit."""
    var = Var("epd_router_example_s", 5, declaration.SECONDS, declaration.ROUTER, minimum=1)
    assert value_problem(var, "5m").endswith("write 300")
    assert value_problem(var, 0) == "epd_router_example_s must be >= 1, got 0"


def _documented_default(cell: str) -> tuple[bool, Any]:
    """(True, value) when a docs table cell is a plain default: a number, true/false, `""`, `[]`, `{}`
    or one backticked word; prose (unset, "the host's codename", ...) is not compared."""
    text = cell.strip()
    code = re.fullmatch(r"`([^`\s]*)`", text)
    if code:
        literal = code[1]
        if literal in ('""', "''"):
            return True, ""
        if literal in ("true", "false") or literal.startswith(("[", "{")):
            return True, yaml.safe_load(literal)
        return True, literal
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return True, yaml.safe_load(text)
    if text in ("true", "false"):
        return True, text == "true"
    return False, None


def test_docs_variable_tables_show_the_declared_defaults():
    """Every docs table row `| `epd_x` | default | ...` whose default is a plain value agrees with the declaration."""
    problems = []
    compared = 0
    for page in sorted(REPO.glob("docs/*.md")):
        for number, line in enumerate(page.read_text().splitlines(), 1):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            # one variable, or several sharing the default (`epd_rollout_batch_ve`, `epd_rollout_batch_pd`)
            names = re.fullmatch(r"`epd_\w+`(?:, `epd_\w+`)*", cells[0]) if len(cells) >= 3 else None
            plain_value, value = _documented_default(cells[1]) if names else (False, None)
            if not plain_value:
                continue
            for name in re.findall(r"epd_\w+", cells[0]):
                if name not in VARIABLES:
                    continue
                compared += 1
                expected = VARIABLES[name].default
                if value != expected and str(value) != str(expected):
                    problems.append(
                        f"{page.relative_to(REPO)}:{number}: {name} documented {cells[1]}, declared {expected!r}"
                    )
    assert compared >= 30
    assert not problems, "\n".join(problems)


def test_pool_settings_may_live_in_the_engine_group_and_rollout_settings_in_the_router_group():
    """group_vars/epd_engines for the pool, group_vars/epd_router for rollouts: hosts outside those
    groups do not have them, and nothing is refused."""
    engine = {"epd_model": "/models/m", "epd_num_ve": 1, "epd_num_pd": 1, "epd_bind_address": "10.0.0.1"}
    engine["epd_client_networks"] = ["10.0.0.0/16"]  # two machines: the firewall needs the client networks
    router = {"epd_rollout_batch_pd": 1, "epd_rr_drain_timeout_s": 300, "epd_bind_address": "10.0.0.2"}
    hostvars = {"n1": engine, "r1": router}
    result = planner.check_inventory(hostvars, {"epd_engines": ["n1"], "epd_router": ["r1"]}, None, set(VARIABLES))
    assert result["problems"] == []


def test_a_fleet_value_set_only_where_it_is_not_read_is_refused():
    engine = {"epd_model": "/models/m", "epd_num_ve": 1, "epd_num_pd": 1, "epd_bind_address": "10.0.0.1"}
    hostvars = {"n1": engine, "r1": {"epd_max_num_seqs": 16}}
    result = planner.check_inventory(hostvars, {"epd_engines": ["n1"], "epd_router": ["r1"]}, None, set(VARIABLES))
    assert result["problems"] == [
        "epd_max_num_seqs differs between hosts (n1: 8, r1: 16); a fleet-wide setting is read from one place: "
        "set it once in group_vars/all (or -e)"
    ]


def test_the_docs_variable_reference_is_generated_from_the_declaration():
    from epd_kit.plan import reference

    text = (REPO / "docs/architecture.md").read_text()
    start, end = text.index(reference.BEGIN), text.index(reference.END) + len(reference.END)
    assert text[start:end] == reference.section(), (
        "docs/architecture.md 'Every variable' is out of date: replace it with the output of "
        "`.venv/bin/python -m epd_kit.plan.reference --write docs/architecture.md`"
    )
