"""Bad input: each case fails in preflight, before any unit is written, with what to change."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from tests.ansible.helpers import LOCAL_HOST, playbook

pytestmark = pytest.mark.ansible

# Any task that reaches a host fails at once: its interpreter does not exist. So a deploy
# that got past the controller checks can never touch this machine.
UNUSABLE_HOST = {"ansible_connection": "local", "ansible_python_interpreter": "/nonexistent/python3"}


def write_inventory(root: Path, hosts: dict[str, dict], router: list[str], group_vars: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "group_vars").mkdir(exist_ok=True)
    (root / "hosts.yml").write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {
                        "epd_engines": {"hosts": hosts},
                        "epd_router": {"hosts": dict.fromkeys(router)},
                    }
                }
            }
        )
    )
    (root / "group_vars/all.yml").write_text(yaml.safe_dump(group_vars))
    return root


def deploy(inventory: Path, *extra: str, **env: str):
    return playbook("-i", str(inventory), "playbooks/deploy.yml", *extra, timeout=300, **env)


def one_host(tmp_path: Path, host_vars: dict | None = None, **group_vars) -> Path:
    host = {"epd_num_ve": 1, "epd_num_pd": 1, **UNUSABLE_HOST, **(host_vars or {})}
    gv = {"epd_model": "/models/Qwen3-VL-32B-Instruct", **group_vars}
    return write_inventory(tmp_path / "inv", {"h1": host}, ["h1"], gv)


def assert_stopped_on_controller(result, message: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert message in output, output[-3000:]
    assert "Preflight on every host" not in output, "the deploy went on to the hosts"


@pytest.mark.parametrize(
    ("group_vars", "host_vars", "message"),
    [
        ({"epd_model": ""}, {}, "epd_model is unset or empty"),
        ({"epd_extra_args": ["--enable-prefix-caching"]}, {}, "prefix caching must stay off"),
        ({"epd_extra_args": ["--mm-encoder-only"]}, {}, "both build roles"),
        ({}, {"epd_slices": {"pd": [4], "ve": [12]}}, "aligned"),
        ({"epd_ve_port_base": 18100, "epd_pd_port_base": 18100}, {}, "port 18100 is used by both"),
        ({"epd_num_pds": 3}, {}, "h1: unknown variable epd_num_pds; did you mean epd_num_pd?"),
    ],
    ids=["empty-model", "prefix-caching", "both-build-roles", "misaligned-slice", "duplicate-port", "typo"],
)
def test_inventory_errors_stop_on_the_controller(tmp_path, group_vars, host_vars, message):
    assert_stopped_on_controller(deploy(one_host(tmp_path, host_vars, **group_vars)), message)


def test_check_mode_runs_the_same_inventory_check(tmp_path):
    result = deploy(one_host(tmp_path, epd_router_prot=18900), "--check")
    assert_stopped_on_controller(result, "h1: unknown variable epd_router_prot; did you mean epd_router_port?")


def test_remote_router_cannot_reach_loopback_engines(tmp_path):
    inventory = write_inventory(
        tmp_path / "inv", {"h1": {"epd_num_pd": 1, **UNUSABLE_HOST}}, ["r1"], {"epd_model": "/models/m"}
    )
    (inventory / "host_vars").mkdir()
    (inventory / "host_vars/r1.yml").write_text(yaml.safe_dump(UNUSABLE_HOST))
    assert_stopped_on_controller(deploy(inventory), "router host r1 cannot reach the engines of h1 on 127.0.0.1")


def test_hub_id_without_token_warns(tmp_path):
    result = deploy(one_host(tmp_path, epd_model="Qwen/Qwen3-VL-32B-Instruct"))
    output = result.stdout + result.stderr
    assert "WARNING: epd_model Qwen/Qwen3-VL-32B-Instruct is a Hugging Face hub id and HF_TOKEN" in output
    assert "Preflight on every host" in output  # a warning, not a failure
    with_token = deploy(one_host(tmp_path / "t", epd_model="Qwen/Qwen3-VL-32B-Instruct"), HF_TOKEN="hf_dummy")
    assert "is a Hugging Face hub id" not in with_token.stdout
    assert "hf_dummy" not in with_token.stdout + with_token.stderr


# ---------------------------------------------------------------- per-host fact checks


def host_check(tmp_path: Path, check: str, host_vars: dict | None = None, **group_vars):
    host = {"epd_num_ve": 1, "epd_num_pd": 1, **LOCAL_HOST, **(host_vars or {})}
    inventory = write_inventory(tmp_path / "inv", {"h1": host}, ["h1"], group_vars)
    return playbook("-i", str(inventory), "tests/ansible/playbooks/host_checks.yml", "-e", f"check={check}")


def checkpoint(root: Path, architectures: list[str]) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"architectures": architectures}))
    return root


def test_vision_language_checkpoint_passes(tmp_path):
    model = checkpoint(tmp_path / "vl", ["Qwen3VLForConditionalGeneration"])
    result = host_check(tmp_path, "checks", epd_model=str(model), epd_preflight_check_ports=False)
    assert result.returncode == 0, result.stdout[-3000:]


def test_text_only_checkpoint_fails_with_the_tutorial_explanation(tmp_path):
    model = checkpoint(tmp_path / "text", ["Qwen3ForCausalLM"])
    result = host_check(tmp_path, "checks", epd_model=str(model), epd_preflight_check_ports=False)
    assert result.returncode != 0
    assert (
        "text-only model" in result.stdout and "unexpected" in result.stdout and "text_neuron_config" in result.stdout
    )


def test_missing_checkpoint_fails(tmp_path):
    result = host_check(tmp_path, "checks", epd_model=str(tmp_path / "absent"), epd_preflight_check_ports=False)
    assert result.returncode != 0
    assert f"{tmp_path / 'absent'}/config.json does not exist on h1" in result.stdout


def test_port_already_bound_fails_naming_the_process(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = host_check(
            tmp_path,
            "checks",
            {"epd_num_ve": 0},
            epd_model=str(checkpoint(tmp_path / "vl", ["Qwen3VLForConditionalGeneration"])),
            epd_text_only=True,
            epd_pd_port_base=port,
            epd_router_port=port + 7,
        )
    assert result.returncode != 0
    assert f"port {port} on h1 is already" in result.stdout and "epd_pd_port_base" in result.stdout


def test_free_ports_pass(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = host_check(
        tmp_path,
        "checks",
        {"epd_num_ve": 0},
        epd_model=str(checkpoint(tmp_path / "vl", ["Qwen3VLForConditionalGeneration"])),
        epd_text_only=True,
        epd_pd_port_base=port,
        epd_router_port=port + 7,
    )
    assert result.returncode == 0, result.stdout[-3000:]


def test_several_dlami_venvs_and_none_chosen_fails(tmp_path):
    for version in ("0_24_0", "0_25_0"):
        (tmp_path / f"aws_neuronx_venv_pytorch_inference_vllm_{version}/bin").mkdir(parents=True)
    result = host_check(
        tmp_path,
        "vllm",
        epd_model="/models/m",
        epd_dlami_venv_glob=str(tmp_path / "aws_neuronx_venv_pytorch_inference_vllm_*"),
    )
    assert result.returncode != 0
    assert (
        "several vLLM Neuron venvs on h1" in result.stdout and "0_24_0" in result.stdout and "0_25_0" in result.stdout
    )
    assert "set epd_engine_venv" in result.stdout


def test_engine_venv_without_nixl_fails_with_the_libfabric_explanation(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").symlink_to("/usr/bin/python3")  # the system python has no nixl
    (venv / "bin/vllm").write_text("#!/bin/sh\n")
    (venv / "bin/vllm").chmod(0o755)
    result = host_check(tmp_path, "vllm", epd_model="/models/m", epd_engine_venv=str(venv))
    assert result.returncode != 0
    assert "import nixl failed" in result.stdout and "unsupported backend 'LIBFABRIC'" in result.stdout
