"""The vLLM-compat tier: the kit's wire bodies against vLLM 0.24.0's own code (docs/compat.md).

It runs only in the environment scripts/compat-env.sh builds. Anywhere else no test module
of it is imported: a run of the whole suite walks past the folder, and a run that names it
fails with the command to use.
"""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

VLLM_VERSION = "0.24.0"
HOW_TO_RUN = "run it in its environment: scripts/compat-env.sh pytest tests/compat (docs/compat.md)"


def _environment_problem() -> str | None:
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return f"vllm is not installed in {sys.prefix}"
    if version != VLLM_VERSION:
        return f"vllm {version} is installed in {sys.prefix}, this tier pins {VLLM_VERSION}"
    return None


if (_problem := _environment_problem()) is None:
    from tests.compat.fixtures import checkpoint, sims, stack  # noqa: F401 - the tier's fixtures
else:
    collect_ignore_glob = ["*"]

    def pytest_sessionstart(session: pytest.Session) -> None:  # only when named: an initial conftest
        raise pytest.UsageError(f"the vLLM-compat tier cannot run here: {_problem}; {HOW_TO_RUN}")
