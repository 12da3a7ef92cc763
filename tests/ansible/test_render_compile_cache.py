"""The engines' compile cache environment as rendered for the trn2 example (compilation_cache.md:
VLLM_CACHE_ROOT, NEURON_LIBTORCH_REMOTE_CACHE; cpu_compilation.md: the strict-mode pair)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ansible.helpers import REPO, playbook
from tests.ansible.systemd_expand import service_command

pytestmark = pytest.mark.ansible

INVENTORY = REPO / "inventory/examples/single-node-1e1pd"
HOST = "trn2-node1"
KIT_CACHE = "/var/cache/epd/neuron-compile-cache"


def engine_environment(out: Path, instance: str = "pd-0") -> tuple[dict[str, str], str]:
    host = out / HOST
    unit = (host / "etc/systemd/system/epd-engine@.service").read_text()
    env_path = f"/etc/epd/engines/{instance}.env"
    _, environment = service_command(
        unit, f"epd-engine@{instance}.service", {env_path: (host / env_path.lstrip("/")).read_text()}
    )
    return environment, unit


def test_the_plugins_cache_root_is_the_kits_directory_and_nothing_else_by_default(rendered):
    environment, unit = engine_environment(rendered(INVENTORY))
    assert environment["VLLM_CACHE_ROOT"] == KIT_CACHE  # the plugin's cache: <root>/neuron/compile_cache
    assert "NEURON_COMPILE_CACHE_URL" not in environment  # torch-neuronx XLA's variable, not the plugin's
    for name in ("NEURON_LIBTORCH_REMOTE_CACHE", "VLLM_NEURON_DISABLE_WARMUP_COMPILE"):
        assert name not in environment
    assert unit.count("ReadWritePaths=") == 1


def test_the_shared_tier_and_strict_mode_reach_every_engine(tmp_path):
    shared = "/mnt/fsx/neuron-cache"
    result = playbook(
        "-i",
        str(INVENTORY),
        "playbooks/render.yml",
        "-e",
        f"render_dir={tmp_path}",
        "-e",
        f"epd_compile_cache_shared_dir={shared}",
        "-e",
        "epd_compile_cache_strict=true",
    )
    assert result.returncode == 0, result.stdout[-3000:]
    for instance in ("ve-0", "pd-0"):
        environment, unit = engine_environment(tmp_path, instance)
        assert environment["VLLM_CACHE_ROOT"] == KIT_CACHE
        assert environment["NEURON_LIBTORCH_REMOTE_CACHE"] == shared
        assert environment["VLLM_NEURON_DISABLE_WARMUP_COMPILE"] == "1"
        assert environment["NEURON_LIBTORCH_DISABLE_GRAPH_CAPTURE_BACKEND"] == "1"
        assert f"ReadWritePaths={shared}" in unit  # writable whatever the unit protects (ProtectHome, ProtectSystem)
