"""The tier runs the vLLM of every Neuron release the kit supports (epd_kit/plan/neuron_releases.py):
a release whose vLLM has no environment here (tests/compat/requirements-vllm-<version>.txt)
would reach users unchecked."""

from __future__ import annotations

from epd_kit.plan.neuron_releases import RELEASES
from tests.compat.conftest import VLLM_VERSIONS


def test_every_releases_vllm_has_a_compat_environment() -> None:
    wanted = {name: release.engine_venv["vllm"].version for name, release in RELEASES.items()}
    assert {name: version for name, version in wanted.items() if version not in VLLM_VERSIONS} == {}
