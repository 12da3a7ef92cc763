"""The Neuron release tables: one home (epd_kit.plan.neuron_releases), shown in docs/provisioning.md,
read by the role through the epd.kit.epd_neuron_release filter."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import yaml

from epd_kit import plan as planner
from epd_kit.plan import EpdPlanError
from epd_kit.plan.command import engine_env, serve_argv
from epd_kit.plan.neuron_releases import (
    DEFAULT_RELEASE,
    RELEASES,
    Pin,
    comparison_table,
    engine_requirements,
    markdown_table,
    neuron_release,
    release_profile,
)
from epd_kit.plan.settings import read_settings
from epd_kit.plan.variables import declared
from tests.ansible.helpers import REPO

DOC = REPO / "docs/provisioning.md"


@pytest.mark.parametrize("name", list(RELEASES))
def test_the_docs_show_each_release_table_as_the_module_has_it(name):
    text = DOC.read_text()
    match = re.search(
        rf"<!-- neuron-release-table {re.escape(name)} -->\n(.*?)\n<!-- /neuron-release-table -->", text, re.S
    )
    assert match, f"docs/provisioning.md has no table for Neuron {name}"
    assert match.group(1) == markdown_table(name), (
        "docs/provisioning.md's table differs from epd_kit/plan/neuron_releases.py: paste markdown_table()"
    )


def test_the_docs_show_the_releases_side_by_side():
    match = re.search(
        r"<!-- neuron-release-comparison -->\n(.*?)\n<!-- /neuron-release-comparison -->", DOC.read_text(), re.S
    )
    assert match and match.group(1) == comparison_table(), "paste comparison_table() into docs/provisioning.md"


@pytest.mark.parametrize("name", list(RELEASES))
def test_every_pin_is_a_version_with_a_source_or_marked_unconfirmed_with_its_override(name):
    release = neuron_release(name)
    for component, version, source in release.table():
        assert source.strip(), f"{component} has no source"
        assert version.strip(), component
    for pin in [*release.system.values(), release.efa_installer, *release.engine_venv.values()]:
        if pin.version is None:  # the table says so and names the operator's override
            assert "set epd_provision_" in pin.source, pin
        else:
            assert re.fullmatch(r"[0-9][0-9A-Za-z.+!~-]*", pin.version), pin
    assert all(pin.version is not None for pin in release.system.values())  # every apt pin is sourced


def test_the_2_33_profile_is_vllm_neuron_0_29_on_the_native_route_with_the_precompile_cache_on():
    profile = release_profile("2.33.0")
    assert profile["engine_venv"]["vllm-neuron"] == "0.29.0.1.2.0" and profile["vllm"] == "0.29.0"
    assert profile["engine_venv"]["neuronx-cc"] == "2.28.7631.0" and profile["engine_venv"]["nki"] == "0.7.0"
    assert profile["system"]["aws-neuronx-dkms"] == "2.31.7.0"
    assert (profile["python_min"], profile["python_max"]) == ("3.11", "3.14")
    assert "Ubuntu 26.04" in profile["os"] and "Ubuntu 22.04" not in profile["os"]
    assert profile["engine_environment"] == {"VLLM_NEURON_BACKEND": "neuron_native"}
    assert profile["engine_venv_unconfirmed"] == ["libtorch-neuronx-lite", "nixl"]
    assert profile["efa_installer"] == ""  # unconfirmed: the role asks for the operator's version
    assert "torch-neuronx" not in profile["engine_venv"]  # vLLM Neuron compiles through libtorch-neuronx-lite


def test_the_2_33_1_profile_is_2_33_0_with_the_patch_releases_packages():
    """2.33.1's notes list what it updates ("All other packages are the same as in Neuron 2.33.0"):
    the driver, runtime and collectives, and libtorch-neuronx-lite's torch 2.13 build (vllm 0.29.0's
    torch), which settles the pin 2.33.0 leaves open; nixl stays unconfirmed."""
    patch, base = release_profile("2.33.1"), release_profile("2.33.0")
    assert patch["system"] == base["system"] | {
        "aws-neuronx-dkms": "2.31.8.0",
        "aws-neuronx-runtime-lib": "2.35.33.0",
        "aws-neuronx-collectives": "2.35.49.0",
    }
    assert patch["engine_venv"] == base["engine_venv"] | {"libtorch-neuronx-lite": "2.13.0.1.0.4089"}
    assert patch["engine_venv_unconfirmed"] == ["nixl"] and patch["vllm"] == "0.29.0"
    assert list(patch["engine_venv"]) == list(base["engine_venv"])  # the same requirement order
    assert patch["engine_environment"] == base["engine_environment"]


def _argv(release: str, role: str) -> list[str]:
    settings = read_settings({"epd_model": "/models/m", "epd_neuron_release": release})
    return serve_argv(settings, role, f"{role}-0", "10.0.0.1", 8000, 9000 if role == "ve" else None)


@pytest.mark.parametrize("role", ["ve", "pd"])
def test_a_release_whose_vllm_is_0_30_or_later_serves_the_routers_route_with_enable_scale_out(monkeypatch, role):
    """vLLM 0.30.0 made the scale-out endpoints (the router's /inference/v1/generate) opt-in with
    --enable-scale-out: every engine of such a release gets it, no engine of an older vLLM does."""
    for name in RELEASES:
        assert "--enable-scale-out" not in _argv(name, role)  # vLLM 0.24 and 0.29 serve the route as they are
    newer = RELEASES["2.33.1"]
    newer = replace(newer, engine_venv=newer.engine_venv | {"vllm": Pin("0.30.0", "a test release")})
    monkeypatch.setitem(RELEASES, "2.33.1", newer)
    argv = _argv("2.33.1", role)
    # ... and --no-mm-device-do-normalize: the router's pixels are normalised already (SERVE_FLAGS)
    flags = ["--enable-scale-out", "--no-mm-device-do-normalize"]
    assert argv.count("--enable-scale-out") == 1 and newer.profile()["serve_flags"] == flags
    assert argv.count("--no-mm-device-do-normalize") == 1
    assert newer.table()[-1][:2] == ("engine serve flags", " ".join(flags))


def test_an_unconfirmed_engine_pin_is_refused_until_the_operator_sets_it():
    with pytest.raises(
        EpdPlanError, match=r"Neuron 2\.33\.0: .* libtorch-neuronx-lite, nixl; set epd_provision_engine_pins"
    ):
        engine_requirements("2.33.0")
    with pytest.raises(EpdPlanError, match=r"of nixl;"):
        engine_requirements("2.33.0", {"libtorch-neuronx-lite": "2.13.0.1.0.1"})
    requirements = engine_requirements("2.33.0", {"libtorch-neuronx-lite": "2.13.0.1.0.1", "nixl": "1.5.1"})
    assert "libtorch-neuronx-lite==2.13.0.1.0.1" in requirements and "vllm==0.29.0" in requirements


def test_the_default_is_the_newest_release_whose_engine_venv_is_fully_sourced():
    sourced = [name for name, release in RELEASES.items() if not release.unconfirmed()]
    assert max(sourced, key=lambda name: tuple(int(p) for p in name.split("."))) == DEFAULT_RELEASE
    assert engine_requirements(DEFAULT_RELEASE)  # installs without the operator's pins


@pytest.mark.parametrize(
    ("backend", "release"), [("vllm", "2.32.0"), ("vllm", "2.33.0"), ("sim", "2.32.0"), ("sim", "2.33.0")]
)
def test_the_engines_environment_follows_the_fleets_release(backend, release):
    settings = read_settings({"epd_model": "/models/m", "epd_engine_backend": backend, "epd_neuron_release": release})
    env = engine_env(settings, [0, 1])
    assert env.get("VLLM_NEURON_BACKEND") == ("neuron_native" if release == "2.33.0" else None)
    # the sim answers as the release's vLLM; a real engine is that vLLM
    assert env.get("EPD_SIM_VLLM") == ({"2.32.0": "0.24", "2.33.0": "0.29"}[release] if backend == "sim" else None)


def test_a_fleet_of_two_releases_is_refused_naming_the_hosts():
    hostvars = {
        "n1": {"epd_model": "/models/m", "epd_num_ve": 1, "epd_num_pd": 1},
        "n2": {"epd_model": "/models/m", "epd_num_pd": 1, "epd_neuron_release": "2.33.0"},
    }
    groups = {"epd_engines": ["n1", "n2"], "epd_router": ["n1"]}
    result = planner.check_inventory(hostvars, groups, None, list(declared()))
    assert result["plan"] is None
    assert any(
        "epd_neuron_release differs between hosts (n1: '2.32.0', n2: '2.33.0')" in p for p in result["problems"]
    ), result["problems"]
    with pytest.raises(
        EpdPlanError, match=r"epd_neuron_release differs between engine hosts \(n1: '2\.32\.0', n2: '2\.33\.0'\)"
    ):
        planner.plan_from_hostvars(hostvars, ["n1", "n2"])


def test_the_2_32_engine_venv_is_vllm_neuron_0_24s_stack_and_nothing_of_2_31():
    venv = release_profile("2.32.0")["engine_venv"]
    assert venv["vllm"] == "0.24.0" and venv["vllm-neuron"] == "0.24.0.1.1.0"
    assert venv["libtorch-neuronx-lite"].startswith("2.11.")  # vllm 0.24.0 requires torch==2.11.0
    assert venv["nixl"] == "1.3.2"  # vllm-neuron 0.24's requirements/core.txt
    assert "torch-neuronx" not in venv  # not part of 2.32.0 (manual.rst)


def test_an_unknown_release_is_refused_naming_the_supported_ones():
    with pytest.raises(EpdPlanError, match=r"epd_neuron_release '2\.31\.0' is not a Neuron release .* 2\.32\.0"):
        neuron_release("2.31.0")


def test_the_inventory_variable_offers_exactly_the_releases_and_their_default():
    variable = declared()["epd_neuron_release"]
    assert variable.choices == tuple(RELEASES) and variable.default == DEFAULT_RELEASE
    spec = yaml.safe_load((REPO / "roles/epd_common/meta/argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["epd_neuron_release"]
    assert option["choices"] == list(RELEASES) and option["default"] == DEFAULT_RELEASE


def _fleet(release: str) -> dict:
    settings = read_settings({"epd_model": "/models/m", "epd_pd_tp": 4, "epd_neuron_release": release})
    hosts = [
        planner.read_host(name, {"epd_num_ve": 1, "epd_num_pd": 2, "epd_bind_address": f"10.0.0.{i}"}, settings)
        for i, name in enumerate(("a", "b"), 1)
    ]
    return planner.plan_fleet(settings, hosts)


def test_a_release_change_rolls_every_engine_one_compiling_canary_per_configuration_first():
    """What deploy.yml rolls when epd_neuron_release changes (docs/operations.md "Upgrading the Neuron
    release"): every engine, since its environment follows the release, and the compile-cache
    rollout's canaries first, so a canary that fails leaves the rest on the old release."""
    old, new = _fleet("2.32.0"), _fleet("2.33.0")
    unit = "[Service]\nExecStart=/venv/bin/vllm serve\n"
    for host in old:
        files = {
            e["instance"]: planner.engine_unit(e, "/venv/bin/vllm", new[host]["start_timeout_s"])["env_file"]
            for e in new[host]["engines"]
        }
        deployed = {
            e["instance"]: "\n".join(
                f"{k}='{v}'"
                for k, v in planner.engine_unit(e, "/venv/bin/vllm", old[host]["start_timeout_s"])["env_file"].items()
            )
            for e in old[host]["engines"]
        }
        assert planner.rollout.changed_engines(files, deployed, unit, unit) == sorted(files)
    configs = {planner.rollout.compile_config(e) for h in new for e in new[h]["engines"]}
    assert configs.isdisjoint({planner.rollout.compile_config(e) for h in old for e in old[h]["engines"]})
    batches, _ = planner.rollout.rollout_batches(new, None, compiles=True)
    assert batches[0].canary and batches[0].pool == "pd+ve" and len(batches[0].engines) == len(configs) == 2
    assert not any(b.canary for b in batches[1:])
