"""The unit-layout filter (argv -> EPD_* variables) and the systemd expander used by the tests."""
from __future__ import annotations

import importlib.util
import json

import pytest

from tests.ansible.helpers import REPO
from tests.ansible.systemd_expand import expand_command, parse_env_file, parse_unit, service_command

pytestmark = pytest.mark.ansible

_spec = importlib.util.spec_from_file_location("epd_unit_layout", REPO / "roles/epd_common/filter_plugins/epd_unit_layout.py")
layout_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout_module)
AnsibleFilterError = layout_module.AnsibleFilterError


def pd_engine(extra=()):
    argv = ["vllm", "serve", "/models/m", "--tensor-parallel-size", "8", "--host", "127.0.0.1", "--port", "18100",
            "--max-model-len", "8192", "--max-num-batched-tokens", "8192", "--max-num-seqs", "8", "--dtype", "bfloat16",
            "--limit-mm-per-prompt", '{"image": 30}', "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0",
            "--additional-config", json.dumps({"mm_language_model_only": True}),
            "--ec-transfer-config", json.dumps({"engine_id": "epd-pd-0"}), *extra]
    return {"engine_id": "epd-pd-0", "instance": "pd-0", "host": "127.0.0.1", "port": 18100, "start_delay_s": 10,
            "argv": argv, "env": {"NEURON_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}}


def test_layout_splits_and_rebuilds_the_argv():
    layout = layout_module.epd_engine_layout(pd_engine(["--seed", "7"]), "/venv/bin/vllm", 3600)
    assert layout["argv"] == ["/venv/bin/vllm"] + pd_engine(["--seed", "7"])["argv"][1:]
    assert layout["role_args"] == ["--mm-processor-cache-gb", "0"]
    assert layout["extra_args"] == ["--seed", "7"]
    assert layout["env_file"]["EPD_READY_TIMEOUT_S"] == str(3600 - 10 - 15)
    assert layout["env_file"]["EPD_HEALTH_URL"] == "http://127.0.0.1:18100/health"


def test_layout_refuses_an_argv_the_unit_cannot_run():
    engine = pd_engine()
    argv = engine["argv"]
    i = argv.index("--host")
    argv[i:i + 2], argv[3:5] = argv[3:5], argv[i:i + 2]  # swap --host with --tensor-parallel-size
    with pytest.raises(AnsibleFilterError, match="order of the unit's ExecStart"):
        layout_module.epd_engine_layout(engine, "/venv/bin/vllm")


def test_layout_refuses_whitespace_in_a_split_argument():
    with pytest.raises(AnsibleFilterError, match="whitespace"):
        layout_module.epd_engine_layout(pd_engine(["--override-generation-config", '{"a": 1}']), "/venv/bin/vllm")


def test_layout_refuses_a_missing_flag():
    engine = pd_engine()
    i = engine["argv"].index("--ec-transfer-config")
    del engine["argv"][i:i + 2]
    with pytest.raises(AnsibleFilterError, match="EPD_EC_TRANSFER_CONFIG"):
        layout_module.epd_engine_layout(engine, "/venv/bin/vllm")


def test_wildcard_bind_is_probed_on_loopback():
    engine = pd_engine()
    engine["host"] = "0.0.0.0"
    assert layout_module.epd_engine_layout(engine, "/x/vllm")["env_file"]["EPD_HEALTH_URL"] == "http://127.0.0.1:18100/health"


def test_expander_braced_is_one_word_unbraced_splits():
    env = {"J": '{"a": 1, "b": 2}', "R": "--x  --y", "E": ""}
    assert expand_command("/bin/e ${J} $R $E ${E} a${J}b $$R %i", "u@inst.service", env) == \
        ["/bin/e", '{"a": 1, "b": 2}', "--x", "--y", "", 'a{"a": 1, "b": 2}b', "$R", "inst"]


def test_env_file_quoting():
    env = parse_env_file("# c\nA='{\"x\": 1}'\nB=\"q \\\"z\\\" \\$HOME\"\nC= plain value  \n; other\nD=''\n")
    assert env == {"A": '{"x": 1}', "B": 'q "z" $HOME', "C": "plain value", "D": ""}


def test_unit_parser_joins_continuations_and_orders_environment():
    unit = "[Service]\nEnvironment=A=1 B=2\nEnvironmentFile=/e/%i.env\nExecStart=/bin/x \\\n  # a comment\n  ${A} \\\n  $B\n"
    argv, env = service_command(unit, "s@k.service", {"/e/k.env": "A=from-file\n"})
    assert argv == ["/bin/x", "from-file", "2"] and env == {"A": "from-file", "B": "2"}
    assert parse_unit(unit).values("Service", "EnvironmentFile") == ["/e/%i.env"]


def test_env_template_round_trips_awkward_values(tmp_path):
    """templates/epd-engine.env.j2 quoting survives systemd's env-file parser for any value."""
    import jinja2

    values = {"A": '{"k": "v"}', "B": "it's $HOME \\ `x` \"q\"", "C": "", "D": "a b"}
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=False).from_string(
        (REPO / "templates/epd-engine.env.j2").read_text())
    text = template.render(ansible_managed="Ansible managed",
                           engine={"engine_id": "e", "role": "pd", "tp": 8, "dp": 1, "cores": [0], "instance": "pd-0"},
                           epd_engine_layout={"env_file": values})
    assert parse_env_file(text) == values
