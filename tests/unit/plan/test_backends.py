"""The engine backends as declared profiles (epd_kit/plan/backends.py): docs/planner.md "Engine
backends" holds each profile, every install route is one task file, roles read the profile's
fields instead of the backend's name, nothing under roles/ reads from tests/, and the profile's
knobs decide the engines' vLLM, the router's hand-off and what is refused."""

from __future__ import annotations

import re

import pytest

from epd_kit import plan as planner
from epd_kit.plan.backends import DEVICES, INSTALL_ROUTES, PROBES, PROFILES, VENVS, EngineProfile, backend_profile
from epd_kit.plan.errors import EpdPlanError
from epd_kit.plan.neuron_releases import HANDOFFS, VLLM_CPU_VERSIONS, front_checks_of, neuron_release
from epd_kit.plan.settings import read_settings
from epd_kit.plan.variables import VARIABLES, VLLM_CPU_REQUIREMENTS
from tests.ansible.helpers import REPO
from tests.vllm_dist import LOCK_LISTS, VLLM_VERSIONS

MODEL = {"epd_model": "/models/m"}
RELEASE_VLLM = neuron_release(read_settings(MODEL).neuron_release).vllm  # the default release's


def _docs_table() -> dict[str, dict[str, str]]:
    text = (REPO / "docs/planner.md").read_text()
    section = text.split("## Engine backends", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    table = {}
    for row in rows[1:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        table[cells[0]] = dict(zip(header, cells, strict=True))
    return table


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def test_the_docs_table_is_the_profiles():
    table = _docs_table()
    assert sorted(table) == sorted(p.name for p in PROFILES.values())
    for profile in PROFILES.values():
        row = table[profile.name]
        spans = "yes" if profile.span_transports is None else "with transport " + ", ".join(profile.span_transports)
        assert row == {
            "profile": profile.name,
            "`epd_engine_backend`": f"`{profile.backend}`",
            "executable": f"`{profile.executable}`",
            "venv": profile.venv,
            "device": profile.device,
            "install route": profile.install_route,
            "probes": ", ".join(profile.probes),
            "Neuron tools on PATH": _yes(profile.neuron_tools),
            "compile cache": _yes(profile.compile_cache),
            "quantizations": ", ".join(profile.quantizations),
            "engines on several hosts": spans,
        }, profile.name


def test_every_field_is_one_of_the_declared_values():
    assert tuple(PROFILES) == VARIABLES["epd_engine_backend"].choices
    for profile in PROFILES.values():
        assert profile.venv in VENVS and profile.save_cache_venv in VENVS, profile.name
        assert profile.device in DEVICES and profile.install_route in INSTALL_ROUTES, profile.name
        assert set(profile.probes) <= set(PROBES), profile.name
        assert planner.BACKEND_EXECUTABLES[profile.backend] == profile.executable
        assert profile.as_dict()["backend"] == profile.backend  # what epd_common_engine_profile carries


def test_each_install_route_is_one_task_file_of_epd_deps():
    tasks = REPO / "roles/epd_deps/tasks"
    routes = {path.name.removeprefix("install_").removesuffix(".yml") for path in tasks.glob("install_*.yml")}
    assert routes == set(INSTALL_ROUTES) == {p.install_route for p in PROFILES.values()}
    main = (tasks / "main.yml").read_text()
    assert main.count('include_tasks: "install_{{ epd_common_engine_profile.install_route }}.yml"') == 1


# the lines that may name epd_engine_backend: the one selection (epd_common's epd_common_engine_profile,
# its comment) and the argument spec's declaration
SELECTION = REPO / "roles/epd_common/vars/main.yml"
DECLARATION = REPO / "roles/epd_common/meta/argument_specs.yml"


def test_roles_and_playbooks_read_the_profile_never_the_backends_name():
    found = []
    for root in ("roles", "playbooks"):
        for path in sorted((REPO / root).rglob("*")):
            if not path.is_file() or path.suffix not in (".yml", ".yaml", ".j2") or path in (SELECTION, DECLARATION):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "epd_engine_backend" in line and not line.lstrip().startswith("#"):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
                # a test of a profile's own name is a backend name test by another spelling
                if re.search(r"epd_common_engine_profile\.(name|backend)\b", line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == []
    selection = [line for line in SELECTION.read_text().splitlines() if "epd_engine_backend" in line]
    assert any("epd.kit.epd_engine_profile" in line for line in SELECTION.read_text().splitlines())
    assert len([line for line in selection if not line.lstrip().startswith("#")]) == 2  # the plan's, else the host's


def test_nothing_under_roles_reads_from_tests():
    found = []
    for path in sorted((REPO / "roles").rglob("*")):
        if path.is_file() and path.suffix in (".yml", ".yaml", ".j2", ".py", ".sh"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"(^|[/'\"\s])tests/", line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == []


def test_the_lock_lists_are_the_deploys_and_the_compat_tier_reads_them_there():
    cpu = PROFILES["vllm-cpu"]
    folder = REPO / cpu.lock_lists
    assert folder == LOCK_LISTS.resolve() and folder.is_relative_to(REPO / "roles")
    assert VLLM_CPU_REQUIREMENTS.startswith(f"{{{{ epd_deps_repo_dir }}}}/{cpu.lock_lists}/requirements-vllm-")
    assert tuple(VLLM_VERSIONS) == cpu.vllm_versions == VLLM_CPU_VERSIONS
    for version in cpu.vllm_versions:
        assert (folder / f"requirements-vllm-{version}.txt").is_file()
    script = (REPO / "scripts/compat-env.sh").read_text()
    assert f"LOCKS=$REPO/{cpu.lock_lists}\n" in script
    assert "tests/compat/requirements" not in script


def test_the_wheelhouse_builder_is_epd_commons_and_every_role_runs_that_one():
    builder = REPO / "roles/epd_common/files/build_engine_wheelhouse.py"
    assert builder.is_file() and not builder.is_symlink()
    readers = [
        REPO / "roles/epd_deps/tasks/install_vllm_cpu.yml",
        REPO / "roles/epd_provision/tasks/validate.yml",
    ]
    for reader in readers:
        assert "epd_common_wheelhouse_builder" in reader.read_text(), reader
    assert "roles/epd_common/files/build_engine_wheelhouse.py" in SELECTION.read_text()
    # the trace store's wheelhouse (epd_observability) is built by the same file, and the old path is gone
    assert (
        "roles/epd_common/files/build_engine_wheelhouse.py"
        in (REPO / "roles/epd_observability/tasks/trace_store.yml").read_text()
    )
    assert not (REPO / "roles/epd_provision/files/build_engine_wheelhouse.py").exists()


def test_an_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(EpdPlanError, match=r"epd_engine_backend must be one of vllm, vllm-cpu, sim, got 'neuron'"):
        backend_profile("neuron")
    with pytest.raises(EpdPlanError, match=r"epd_engine_backend must be one of vllm, vllm-cpu, sim, got 'gpu'"):
        read_settings({**MODEL, "epd_engine_backend": "gpu"})


@pytest.mark.parametrize("backend", list(PROFILES))
def test_the_engines_vllm_is_the_chosen_one_only_where_the_backend_has_a_choice(backend):
    chosen = {"epd_vllm_cpu_vllm": "0.32.0", "epd_vllm_cpu_ec_transport": "nixl"}
    profile = read_settings({**MODEL, "epd_engine_backend": backend, **chosen}).profile
    chosen = bool(PROFILES[backend].vllm_versions)
    assert profile.vllm == ("0.32.0" if chosen else RELEASE_VLLM)
    assert profile.handoff == (HANDOFFS[1] if chosen else HANDOFFS[0])
    assert profile.front_checks == front_checks_of(profile.vllm)
    assert profile.upstream_nixl == chosen


def test_vllm_cpu_engines_span_hosts_with_nixl_only_and_the_plan_agrees():
    cpu = PROFILES["vllm-cpu"]
    assert not EngineProfile(cpu, RELEASE_VLLM, ec_transport="shared-dir").spans_hosts
    assert EngineProfile(cpu, RELEASE_VLLM, ec_transport="nixl").spans_hosts
    for backend in ("vllm", "sim"):
        assert EngineProfile(PROFILES[backend], RELEASE_VLLM, ec_transport="shared-dir").spans_hosts
    # the plan refuses what the profile says cannot span (plan/fleet.py's check), a VE on one host, a PD on another
    common = {**MODEL, "epd_engine_backend": "vllm-cpu", "epd_ve_tp": 1, "epd_ve_dp": 1, "epd_pd_tp": 1}
    for transport in ("shared-dir", "nixl"):
        settings = {**common, "epd_vllm_cpu_ec_transport": transport}
        hostvars = {
            "a": {**settings, "epd_num_ve": 1, "epd_bind_address": "10.0.0.1"},
            "b": {**settings, "epd_num_pd": 1, "epd_bind_address": "10.0.0.2"},
        }
        if read_settings(settings).profile.spans_hosts:
            assert planner.plan_from_hostvars(hostvars, ["a", "b"])
        else:
            with pytest.raises(EpdPlanError, match="runs engines on one host"):
                planner.plan_from_hostvars(hostvars, ["a", "b"])


def test_what_a_backend_refuses_names_the_fix():
    cpu = PROFILES["vllm-cpu"]
    assert EngineProfile(cpu, RELEASE_VLLM).refusals("bf16") == []
    [quantization] = EngineProfile(cpu, RELEASE_VLLM).refusals("mxfp8")
    assert "set epd_quantization: bf16" in quantization
    [transport] = EngineProfile(cpu, RELEASE_VLLM, vllm_choice="0.32.0", ec_transport="shared-dir").refusals("bf16")
    assert "set epd_vllm_cpu_ec_transport nixl" in transport
    assert EngineProfile(cpu, RELEASE_VLLM, vllm_choice="0.32.0", ec_transport="nixl").refusals("bf16") == []
    for backend in ("vllm", "sim"):  # the Neuron plugin (and the sim as it) quantizes
        assert EngineProfile(PROFILES[backend], RELEASE_VLLM, vllm_choice="0.32.0").refusals("mxfp8") == []
