"""The engine command model (epd_kit.plan.command / unit): argv, environment, unit variables, ExecStart.

The unit's ExecStart (from SERVE_LINE) expanded with the unit variables (from the same command)
is the planner's argv for any settings; the simulator's launcher runs the same command."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_kit import plan
from epd_kit.plan import managed
from epd_kit.sim import launch
from tests.ansible.systemd_expand import expand_command, parse_unit
from tests.golden.tutorial import TUTORIAL_FLAGS

MODEL = "/models/Qwen3-VL-32B-Instruct"
TOKEN = st.text(
    st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="$\\\"'"), min_size=1, max_size=12
)


def systemd_argv(executable: str, variables: dict[str, str]) -> list[str]:
    """What systemd runs: the unit's ExecStart expanded with the env file's variables."""
    unit = parse_unit(f"[Service]\nExecStart={plan.exec_start(executable)}\n")
    return expand_command(unit.values("Service", "ExecStart")[0], "epd-engine@x.service", variables)


@settings(max_examples=150, deadline=None)
@given(
    role=st.sampled_from(plan.ROLES),
    tp=st.sampled_from([1, 2, 4, 8]),
    images=st.integers(1, 64),
    edge_patches=st.integers(1, 40),
    quantization=st.sampled_from(["bf16", "mxfp8"]),
    backend=st.sampled_from(["vllm", "sim"]),
    extra=st.lists(
        TOKEN.filter(lambda t: t.split("=", 1)[0] not in plan.MANAGED_FLAGS and not t.startswith("--mm")), max_size=4
    ),
    model=st.sampled_from([MODEL, "Qwen/Qwen3-VL-32B-Instruct", "/m/with $dollar and 'quotes'"]),
)
def test_unit_expands_to_the_planner_argv(role, tp, images, edge_patches, quantization, backend, extra, model):
    settings_ = plan.read_settings(
        {
            "epd_model": model,
            "epd_ve_tp": tp,
            "epd_ve_dp": 1,
            "epd_pd_tp": tp,
            "epd_images_per_prompt": images,
            "epd_image_edge": 16 * edge_patches,
            "epd_quantization": quantization,
            "epd_engine_backend": backend,
            "epd_extra_args": extra,
            "epd_modules_to_not_convert": ["lm_head"],
        }
    )
    command = plan.engine_command(settings_, role, f"epd-{role}-3", "10.0.0.7", 18303, 14612 if role == "ve" else None)
    argv = command.argv(settings_.executable)
    assert argv == plan.serve_argv(settings_, role, f"epd-{role}-3", "10.0.0.7", 18303, 14612 if role == "ve" else None)
    assert systemd_argv("/venv/bin/" + argv[0], command.unit_variables()) == ["/venv/bin/" + argv[0], *argv[1:]]


def test_serve_line_is_the_tutorial_order_and_every_flag_is_managed():
    flags = [piece.flag for piece in plan.SERVE_LINE if piece.flag]
    role_flags = [flag for flags_ in plan.ROLE_FLAGS.values() for flag in flags_ if flag.startswith("--")]
    assert flags == [flag for flag in TUTORIAL_FLAGS if flag not in role_flags]  # the role flags: $EPD_ROLE_ARGS
    unmanaged = [flag for flag in flags + role_flags if flag not in plan.MANAGED_FLAGS]
    assert unmanaged == ["--mm-encoder-only"]  # refused with its own message (test_planner.test_bad_extra_args)


def test_exec_start_names_each_variable_once():
    text = plan.exec_start("/opt/epd/venv/bin/epd-sim")
    assert text.startswith(
        "/opt/epd/venv/bin/epd-sim serve ${EPD_MODEL} \\\n    --tensor-parallel-size ${EPD_TENSOR_PARALLEL_SIZE} \\\n"
    )
    assert text.endswith("\\\n    $EPD_EXTRA_ARGS")
    for piece in plan.SERVE_LINE:
        if piece.variable:
            reference = f"${piece.variable}" if piece.split else f"${{{piece.variable}}}"
            assert text.count(reference) == 1


def test_unit_variables_name_every_piece_and_join_the_lists():
    settings_ = plan.read_settings({"epd_model": MODEL, "epd_extra_args": ["--seed", "7"]})
    variables = plan.engine_command(settings_, "ve", "epd-ve-0", "127.0.0.1", 18300, 14600).unit_variables()
    assert list(variables)[-2:] == ["EPD_ROLE_ARGS", "EPD_EXTRA_ARGS"]
    assert variables["EPD_ROLE_ARGS"] == "--mm-encoder-only --no-async-scheduling"
    assert variables["EPD_EXTRA_ARGS"] == "--seed 7"
    assert set(variables) == {piece.variable for piece in plan.SERVE_LINE if piece.variable}


def test_engine_env_is_the_one_place_of_the_efa_settings():
    settings_ = plan.read_settings({"epd_model": MODEL, "epd_engine_environment": {"NEURON_RT_LOG_LEVEL": "INFO"}})
    env = plan.engine_env(settings_, [8, 9, 10, 11])
    assert env == {
        "NEURON_VISIBLE_DEVICES": "8,9,10,11",
        **plan.EFA_ENVIRONMENT,
        "VLLM_NEURON_COMPILATION_TIMEOUT": "6000",
        "NEURON_LIBTORCH_COMPILATION_TIMEOUT": "6000",
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "6000",
        "VLLM_ENGINE_READY_TIMEOUT_S": "6300",
        "HF_HUB_OFFLINE": "1",
        "NEURON_RT_LOG_LEVEL": "INFO",
    }
    assert plan.EFA_ENVIRONMENT == {"FI_EFA_ENABLE_SHM_TRANSFER": "0", "FI_EFA_USE_DEVICE_RDMA": "1"}
    assert set(plan.EFA_ENVIRONMENT) < set(plan.MANAGED_ENV)


def test_every_cold_start_timeout_follows_the_compile_budget_and_the_operator_cannot_set_it_twice():
    """vllm-neuron docs: NEURON_LIBTORCH_COMPILATION_TIMEOUT (a lock wait, 600 s), VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
    and VLLM_ENGINE_READY_TIMEOUT_S are raised with the compile budget; left at a default, a cold start the
    budget allows is cut short."""
    for role_settings in ({"epd_engine_backend": "sim"}, {}):
        settings_ = plan.read_settings({"epd_model": MODEL, "epd_compilation_timeout_s": 900, **role_settings})
        env = plan.engine_env(settings_, [0])
        assert {name: env[name] for name in managed.COLD_START_TIMEOUTS} == {
            "VLLM_NEURON_COMPILATION_TIMEOUT": "900",
            "NEURON_LIBTORCH_COMPILATION_TIMEOUT": "900",  # an engine waiting for another's compile of its graph
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "900",
            "VLLM_ENGINE_READY_TIMEOUT_S": str(900 + managed.ENGINE_READY_MARGIN_S),
        }
    # vLLM gives up before the unit's readiness gate does (EPD_READY_TIMEOUT_S of the default start budget)
    settings_ = plan.read_settings({"epd_model": MODEL, "epd_compilation_timeout_s": 900})
    (host,) = plan.plan_fleet(settings_, [plan.read_host("n1", {"epd_num_pd": 1}, settings_)]).values()
    (pd,) = host["engines"]
    unit = plan.engine_unit(pd, "/venv/bin/vllm", host["start_timeout_s"])
    assert int(pd["env"]["VLLM_ENGINE_READY_TIMEOUT_S"]) < int(unit["env_file"]["EPD_READY_TIMEOUT_S"])
    assert set(managed.COLD_START_TIMEOUTS) < set(plan.MANAGED_ENV)
    for name in managed.COLD_START_TIMEOUTS:
        with pytest.raises(plan.EpdPlanError, match=f"sets {name}: the kit derives it from epd_compilation_timeout_s"):
            plan.read_settings({"epd_model": MODEL, "epd_engine_environment": {name: "60"}})


def test_engine_unit_env_file_order_and_readiness_budget():
    settings_ = plan.read_settings({"epd_model": MODEL, "epd_start_stagger_s": 10})
    specs = [plan.read_host("n1", {"epd_num_ve": 1, "epd_num_pd": 1}, settings_)]
    pd, ve = plan.plan_fleet(settings_, specs)["n1"]["engines"]
    unit = plan.engine_unit(ve, "/venv/bin/vllm", 3600)
    assert unit["argv"] == ["/venv/bin/vllm", *ve["argv"][1:]]
    names = list(unit["env_file"])
    env_count = len(ve["env"])
    assert names[:env_count] == sorted(ve["env"]) and names[env_count:-3] == list(ve["unit_variables"])
    assert names[-3:] == ["EPD_START_DELAY_S", "EPD_HEALTH_URL", "EPD_READY_TIMEOUT_S"]
    assert (unit["env_file"]["EPD_START_DELAY_S"], unit["env_file"]["EPD_READY_TIMEOUT_S"]) == (
        "10",
        str(3600 - 10 - 15),
    )
    assert unit["env_file"]["EPD_HEALTH_URL"] == "http://127.0.0.1:18300/health"
    assert plan.engine_unit(pd, "/x", 40)["env_file"]["EPD_READY_TIMEOUT_S"] == "30"  # never below 30 s


@pytest.mark.parametrize(
    ("host", "url"), [("0.0.0.0", "http://127.0.0.1:18100/health"), ("fd00::7", "http://[fd00::7]:18100/health")]
)
def test_engine_unit_probes_a_wildcard_on_loopback_and_brackets_ipv6(host, url):
    engine = {"argv": ["vllm", "serve"], "unit_variables": {}, "env": {}, "host": host, "port": 18100}
    assert plan.engine_unit(engine, "/x", 3600)["env_file"]["EPD_HEALTH_URL"] == url


def test_engine_unit_refuses_a_line_break():
    engine = {
        "argv": ["vllm", "serve"],
        "unit_variables": {"EPD_MODEL": "a\nb"},
        "env": {},
        "port": 1,
        "engine_id": "e",
    }
    with pytest.raises(plan.EpdPlanError, match="e: EPD_MODEL contains a line break"):
        plan.engine_unit(engine, "/x", 3600)


def test_engine_command_replace_and_merge_json():
    settings_ = plan.read_settings({"epd_model": MODEL})
    command = plan.engine_command(settings_, "pd", "epd-pd-0", "127.0.0.1", 18100, None)
    changed = command.merge_json("EPD_EC_TRANSFER_CONFIG", {"ec_connector_extra_config": {"transfer_timeout_sec": 3}})
    ec = json.loads(changed.values["EPD_EC_TRANSFER_CONFIG"])
    assert ec["ec_connector_extra_config"] == {"backends": ["LIBFABRIC"], "transfer_timeout_sec": 3}
    assert command.replace(EPD_PORT="1").argv("x")[command.argv("x").index("--port") + 1] == "1"
    with pytest.raises(plan.EpdPlanError, match="unknown engine command variables"):
        command.replace(EPD_NOPE="1")
    with pytest.raises(plan.EpdPlanError, match="engine command lacks"):
        plan.EngineCommand({"EPD_MODEL": MODEL})


def test_merge_is_recursive_for_mappings_only():
    assert plan.command.merge({"a": {"b": 1, "c": [1]}, "d": 1}, {"a": {"c": [2], "e": 3}, "d": {"x": 1}}) == {
        "a": {"b": 1, "c": [2], "e": 3},
        "d": {"x": 1},
    }


def test_the_sim_launcher_runs_the_kits_command():
    settings_ = plan.read_settings({"epd_model": MODEL, "epd_engine_backend": "sim"})
    specs = [plan.read_host("n1", {"epd_num_ve": 1, "epd_num_pd": 1}, settings_)]
    engines = {e["role"]: e for e in plan.plan_fleet(settings_, specs)["n1"]["engines"]}
    assert launch.serve_argv("pd", MODEL, 18100, executable="epd-sim") == engines["pd"]["argv"]
    assert launch.serve_argv("ve", MODEL, 18300, side_channel_port=14600, executable="epd-sim") == engines["ve"]["argv"]
    assert launch.ve_argv(MODEL, 18300, 14600, executable="epd-sim") == engines["ve"]["argv"]
    assert launch.pd_argv(MODEL, 18100, executable="epd-sim") == engines["pd"]["argv"]
    env = launch.engine_env("8,9,10,11", base={})
    # PATH: what the kit's sim unit sets beside the planned environment (the stand-in compiler first)
    assert env.pop("PATH").split(":")[0] == str(launch.STANDIN_BIN)
    assert env == engines["ve"]["env"]


def test_the_sim_launcher_departs_from_the_kit_only_when_asked():
    argv = launch.pd_argv(None, 18100, extra_flags=(), vab=2048)
    assert argv[2] == "--tensor-parallel-size" and plan.PREFIX_CACHING_OFF not in argv
    vision = json.loads(argv[argv.index("--additional-config") + 1])["vision_neuron_config"]
    assert (vision["vision_attention_block_size"], vision["num_vision_tokens_buckets"]) == (2048, [30 * 2048])
    assert "FI_EFA_USE_DEVICE_RDMA" not in launch.engine_env("0", efa=False, base={})


def test_a_local_tp1_engine_for_the_router_tests():
    """What tests/router_processes/harness.py runs: one tp=1 engine per role, engine id and ports of its own."""
    ve = launch.serve_argv("ve", MODEL, 4001, side_channel_port=4002, engine_id="epd-ve-3", tp=1, dp=1, max_num_seqs=2)
    pd = launch.serve_argv("pd", MODEL, 4003, engine_id="epd-pd-5", tp=1, max_num_seqs=2)
    assert ve[ve.index("--tensor-parallel-size") + 1] == pd[pd.index("--tensor-parallel-size") + 1] == "1"
    assert (ve[ve.index("--max-num-seqs") + 1], pd[pd.index("--max-num-seqs") + 1]) == ("1", "2")
    ve_ec = json.loads(ve[ve.index("--ec-transfer-config") + 1])
    assert (ve_ec["engine_id"], ve_ec["ec_connector_extra_config"]["side_channel_port"]) == ("epd-ve-3", 4002)
    assert json.loads(ve[ve.index("--additional-config") + 1])["vision_neuron_config"]["dp_size"] == 1
