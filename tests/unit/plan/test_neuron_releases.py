"""The Neuron release tables: one home (epd_kit.plan.neuron_releases), shown in docs/provisioning.md,
read by the role through the epd.kit.epd_neuron_release filter."""

from __future__ import annotations

import re

import pytest
import yaml

from epd_kit.plan import EpdPlanError
from epd_kit.plan.neuron_releases import DEFAULT_RELEASE, RELEASES, markdown_table, neuron_release, release_profile
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


@pytest.mark.parametrize("name", list(RELEASES))
def test_every_pin_is_a_version_with_a_source(name):
    release = neuron_release(name)
    for component, version, source in release.table():
        assert source.strip(), f"{component} has no source"
        assert version.strip(), component
    for pin in [*release.system.values(), release.efa_installer, *release.engine_venv.values()]:
        assert re.fullmatch(r"[0-9][0-9A-Za-z.+!~-]*", pin.version), pin


def test_the_2_32_engine_venv_is_vllm_neuron_0_24s_stack_and_nothing_of_2_31():
    venv = release_profile("2.32.0")["engine_venv"]
    assert venv["vllm"] == "0.24.0" and venv["vllm-neuron"] == "0.24.0.1.1.0"
    assert venv["libtorch-neuronx-lite"].startswith("2.11.")  # vllm 0.24.0 requires torch==2.11.0
    assert venv["nixl"] == "1.3.2"  # vllm-neuron 0.24's requirements/core.txt
    assert "torch-neuronx" not in venv  # not part of 2.32.0 (manual.rst)


def test_an_unknown_release_is_refused_naming_the_supported_ones():
    with pytest.raises(EpdPlanError, match=r"epd_neuron_release '2\.31\.0' is not a Neuron release .* 2\.32\.0"):
        neuron_release("2.31.0")


def test_the_inventory_variable_offers_exactly_the_releases_and_defaults_to_the_newest():
    variable = declared()["epd_neuron_release"]
    assert variable.choices == tuple(RELEASES) and variable.default == DEFAULT_RELEASE
    assert max(RELEASES, key=lambda name: tuple(int(p) for p in name.split("."))) == DEFAULT_RELEASE
    spec = yaml.safe_load((REPO / "roles/epd_common/meta/argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["epd_neuron_release"]
    assert option["choices"] == list(RELEASES) and option["default"] == DEFAULT_RELEASE
