"""Golden: the rendered single-node-1e1pd units run exactly the tutorial's VE-0 and PD-0 commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ansible.helpers import REPO
from tests.ansible.systemd_expand import service_command
from tests.golden.tutorial import TUTORIAL_EXPORTS, tutorial_command

pytestmark = pytest.mark.ansible

INVENTORY = REPO / "inventory/examples/single-node-1e1pd"
HOST = "trn2-node1"
MODEL = "/models/Qwen3-VL-32B-Instruct"  # the example's epd_model, the tutorial's local-checkpoint form
JSON_FLAGS = {"--limit-mm-per-prompt", "--additional-config", "--ec-transfer-config"}


def rendered_command(out: Path, instance: str) -> tuple[list[str], dict[str, str], dict]:
    host = out / HOST
    unit = (host / "etc/systemd/system/epd-engine@.service").read_text()
    env_path = f"/etc/epd/engines/{instance}.env"
    argv, environment = service_command(
        unit, f"epd-engine@{instance}.service", {env_path: (host / env_path.lstrip("/")).read_text()}
    )
    return argv, environment, json.loads((host / f"engines/{instance}.json").read_text())


@pytest.mark.parametrize("instance", ["ve-0", "pd-0"])
def test_rendered_engine_runs_the_tutorial_command(instance, rendered):
    out = rendered(INVENTORY)
    tutorial_env, tutorial_argv = tutorial_command(instance, MODEL)
    argv, environment, record = rendered_command(out, instance)

    assert record["argv"] == argv, "render JSON and the unit disagree"
    assert Path(argv[0]).name == tutorial_argv[0] == "vllm"
    assert len(argv) == len(tutorial_argv), f"{argv[1:]} != {tutorial_argv[1:]}"
    for position, (ours, theirs) in enumerate(zip(argv[1:], tutorial_argv[1:], strict=False), start=1):
        flag = argv[position - 1]
        if flag in JSON_FLAGS:
            assert json.loads(ours) == json.loads(theirs), f"{flag} JSON differs"
        else:
            assert ours == theirs, f"token {position} ({flag} ...): {ours!r} != {theirs!r}"
    for key, value in {**tutorial_env, **TUTORIAL_EXPORTS}.items():
        assert environment.get(key) == value, f"{key}: {environment.get(key)!r} != {value!r}"
        assert record["environment"].get(key) == value


def test_golden_parser_sees_the_tutorial_layout():
    """The golden files themselves: the tutorial's 1E1PD table (guards against a broken parse)."""
    ve_env, ve = tutorial_command("ve-0", MODEL)
    pd_env, pd = tutorial_command("pd-0", MODEL)
    assert ve_env == {"NEURON_VISIBLE_DEVICES": "8,9,10,11"} and pd_env == {"NEURON_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert ve[ve.index("--port") + 1] == "18300" and pd[pd.index("--port") + 1] == "18100"
    assert (
        json.loads(ve[ve.index("--ec-transfer-config") + 1])["ec_connector_extra_config"]["side_channel_port"] == 14600
    )
    assert ve[2] == pd[2] == MODEL and "--no-enable-prefix-caching" in ve and "--no-enable-prefix-caching" in pd


def test_sim_engines_find_the_sims_stand_in_compiler_and_no_venv_holds_one(rendered):
    """The sim backend's unit, like a vllm unit, puts a neuronx-cc first on PATH (a cache miss needs
    one): the sim's stand-in in a directory of its own, never a file in the kit venv that an operator
    of a real host would find (roles/epd_engines: epd_engines_loader_environment)."""
    out = rendered(REPO / "inventory/sandbox/one-host")
    (unit_path,) = out.glob("*/etc/systemd/system/epd-engine@.service")
    (record_path, *_) = sorted(out.glob("*/engines/*.json"))
    record = json.loads(record_path.read_text())
    path = record["environment"]["PATH"].split(":")
    assert path[:2] == ["/etc/epd/sim-compiler", str(Path(record["argv"][0]).parent)], path
    assert f"Environment=PATH={record['environment']['PATH']}\n" in unit_path.read_text()
    assert "LD_LIBRARY_PATH" not in record["environment"]  # the loader path is the vllm backend's
    standin = REPO / "router/epd_kit/sim/standin_bin/neuronx-cc"
    assert standin.stat().st_mode & 0o111 and "compiles nothing" in standin.read_text()
