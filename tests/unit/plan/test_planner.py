"""The topology planner (epd_kit.plan): layout rules, the engine command, argv/env, every error."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from epd_kit import plan as planner
from tests.ansible import helpers
from tests.budget import scaled
from tests.golden.tutorial import KIT_EXPORTS, TUTORIAL_EXPORTS, tutorial_command

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "inventory" / "examples"
MODEL = "/models/Qwen3-VL-32B-Instruct"
PlanError = planner.EpdPlanError


def load_example(name):
    """(hostvars, engine hosts) of an example inventory: group_vars/all/*.yml under host vars."""
    root = EXAMPLES / name
    common = {}
    for path in sorted((root / "group_vars" / "all").glob("*.yml")):
        common.update(yaml.safe_load(path.read_text()) or {})
    children = yaml.safe_load((root / "hosts.yml").read_text())["all"]["children"]
    engines = children["epd_engines"]["hosts"]
    hostvars = {host: {**common, **(values or {})} for host, values in engines.items()}
    return hostvars, list(engines)


def plan_of(host_vars=None, *, hosts=None, faulted=None, **common):
    """Plan one host n1 (or `hosts`: {name: vars}) with group vars `common`."""
    common.setdefault("epd_model", MODEL)
    hosts = hosts if hosts is not None else {"n1": host_vars or {}}
    hostvars = {name: {**common, **values} for name, values in hosts.items()}
    return planner.plan_from_hostvars(hostvars, list(hosts), faulted=faulted)


def engines(plan, host="n1"):
    return {e["instance"]: e for e in plan[host]["engines"]}


def error_of(*args, **kwargs):
    with pytest.raises(PlanError) as info:
        plan_of(*args, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- golden: tutorial


@pytest.mark.parametrize("instance", ["ve-0", "pd-0"])
def test_single_node_example_is_the_tutorial_command(instance):
    hostvars, hosts = load_example("single-node-1e1pd")
    engine = engines(planner.plan_from_hostvars(hostvars, hosts), "trn2-node1")[instance]
    env, argv = tutorial_command(instance, hostvars["trn2-node1"]["epd_model"])
    assert engine["argv"] == argv  # token by token, JSON strings byte for byte
    for flag in ("--limit-mm-per-prompt", "--additional-config", "--ec-transfer-config"):
        ours = engine["argv"][engine["argv"].index(flag) + 1]
        theirs = argv[argv.index(flag) + 1]
        assert json.loads(ours) == json.loads(theirs)
        assert list(json.loads(ours)) == list(json.loads(theirs))  # key order too
    assert engine["env"] == {**env, **TUTORIAL_EXPORTS, **KIT_EXPORTS}


def test_single_node_example_layout_is_the_tutorial_table():
    hostvars, hosts = load_example("single-node-1e1pd")
    plan = planner.plan_from_hostvars(hostvars, hosts)
    host = plan["trn2-node1"]
    assert [
        (e["instance"], e["engine_id"], e["role"], e["cores"], e["port"], e["side_channel_port"])
        for e in host["engines"]
    ] == [
        ("pd-0", "epd-pd-0", "pd", list(range(8)), 18100, None),
        ("ve-0", "epd-ve-0", "ve", list(range(8, 12)), 18300, 14600),
    ]
    assert engines(plan, "trn2-node1")["ve-0"]["side_channel_ports"] == [14600, 14601, 14602, 14603]
    assert (host["bind_address"], host["usable_cores"]) == ("127.0.0.1", 64)
    settings = planner.fleet_settings(hostvars, hosts).as_dict()
    assert settings["epd_router_port"] == 18800
    assert planner.router_endpoints(plan) == {
        "ve": [{"id": "epd-ve-0", "url": "http://127.0.0.1:18300", "state": "active"}],
        "pd": [{"id": "epd-pd-0", "url": "http://127.0.0.1:18100", "state": "active"}],
    }


def test_2e7pd_fills_64_cores_widest_first():
    hostvars, hosts = load_example("trn2-2e7pd")
    plan = planner.plan_from_hostvars(hostvars, hosts)
    layout = [
        (e["instance"], e["cores"][0], e["cores"][-1], e["port"], e["side_channel_port"])
        for e in plan["trn2-node1"]["engines"]
    ]
    assert layout == [(f"pd-{j}", 8 * j, 8 * j + 7, 18100 + j, None) for j in range(7)] + [
        ("ve-0", 56, 59, 18300, 14600),
        ("ve-1", 60, 63, 18301, 14604),
    ]
    assert [e["start_delay_s"] for e in plan["trn2-node1"]["engines"]] == [10 * i for i in range(9)]


def test_multi_node_ids_carry_the_host_label_and_numbers_are_per_host():
    hostvars, hosts = load_example("multi-node")
    plan = planner.plan_from_hostvars(hostvars, hosts)
    assert hosts == ["trn2-a", "trn2-b", "trn2-c"]
    a, b, c = (engines(plan, h) for h in hosts)
    assert sorted(a) == [f"pd-{j}" for j in range(6)] + [f"ve-{i}" for i in range(4)]
    assert sorted(b) == sorted(c) == [f"pd-{j}" for j in range(8)]
    assert (b["pd-0"]["port"], c["pd-0"]["port"], c["pd-7"]["port"]) == (18100, 18100, 18107)
    assert (b["pd-0"]["engine_id"], c["pd-7"]["engine_id"]) == ("epd-trn2-b-pd-0", "epd-trn2-c-pd-7")
    assert b["pd-0"]["url"] == "http://10.0.1.32:18100"
    ve3 = json.loads(a["ve-3"]["argv"][a["ve-3"]["argv"].index("--ec-transfer-config") + 1])
    assert ve3["engine_id"] == "epd-trn2-a-ve-3"
    assert ve3["ec_connector_extra_config"]["side_channel_host"] == "10.0.1.31"
    assert ve3["ec_connector_extra_config"]["side_channel_port"] == 14612
    assert a["ve-3"]["cores"] == [60, 61, 62, 63] and a["pd-5"]["cores"] == list(range(40, 48))
    endpoints = planner.router_endpoints(plan)
    assert [e["id"] for e in endpoints["pd"]] == [
        *(f"epd-trn2-a-pd-{j}" for j in range(6)),
        *(f"epd-{host}-pd-{j}" for host in ("trn2-b", "trn2-c") for j in range(8)),
    ]
    assert len({e["url"] for e in endpoints["pd"] + endpoints["ve"]}) == 26


def engine_units(plan, host):
    """What a host's engines run: unit instance -> (argv, env file) as the unit expands them."""
    return {
        e["instance"]: planner.engine_unit(e, "/venv/bin/vllm", plan[host]["start_timeout_s"])
        for e in plan[host]["engines"]
    }


def test_removing_a_pd_on_one_host_changes_no_engine_of_the_other_hosts():
    hostvars, hosts = load_example("multi-node")
    before = planner.plan_from_hostvars(hostvars, hosts)
    fewer = {**hostvars, "trn2-a": {**hostvars["trn2-a"], "epd_num_pd": hostvars["trn2-a"]["epd_num_pd"] - 1}}
    after = planner.plan_from_hostvars(fewer, hosts)
    assert len(after["trn2-a"]["engines"]) == len(before["trn2-a"]["engines"]) - 1
    for host in ("trn2-b", "trn2-c"):
        assert after[host] == before[host]
        assert engine_units(after, host) == engine_units(before, host)


def test_an_id_label_pins_a_hosts_ids_and_must_be_unique_and_id_safe():
    hosts = {
        "n1": {"epd_num_ve": 1, "epd_bind_address": "10.0.0.1"},
        "n2": {"epd_num_pd": 1, "epd_bind_address": "10.0.0.2"},
    }
    pinned = plan_of(hosts={**hosts, "n2": {**hosts["n2"], "epd_engine_id_label": "rack7"}})
    assert [e["engine_id"] for e in pinned["n2"]["engines"]] == ["epd-rack7-pd-0"]
    same = {**hosts, "n2": {**hosts["n2"], "epd_engine_id_label": "n1"}}
    assert "n1 and n2 both label their engine ids 'n1'" in error_of(hosts=same)
    bad = {**hosts, "n2": {**hosts["n2"], "epd_engine_id_label": "rack 7"}}
    assert "n2: the engine id label 'rack 7' must be letters, digits" in error_of(hosts=bad)


# --------------------------------------------------------------------------- rules


def test_derived_vision_bucket_and_block():
    settings = planner.read_settings({"epd_model": MODEL})
    assert (settings.vision_tokens_bucket, settings.vision_attention_block_size) == (30720, 1024)
    other = planner.read_settings(
        {"epd_model": MODEL, "epd_images_per_prompt": 4, "epd_image_edge": 448, "epd_patch_size": 14}
    )
    assert (other.vision_tokens_bucket, other.vision_attention_block_size) == (4 * 32 * 32, 1024)
    pd = engines(plan_of({"epd_num_pd": 1}, epd_images_per_prompt=4, epd_image_edge=448, epd_patch_size=14))["pd-0"]
    config = json.loads(pd["argv"][pd["argv"].index("--additional-config") + 1])
    assert config["vision_neuron_config"]["num_vision_tokens_buckets"] == [4096]
    assert pd["argv"][pd["argv"].index("--limit-mm-per-prompt") + 1] == '{"image": 4}'


def test_widest_tp_goes_first_even_when_it_is_the_ve():
    plan = plan_of({"epd_num_ve": 1, "epd_num_pd": 1}, epd_ve_tp=8, epd_ve_dp=2, epd_pd_tp=4)
    assert engines(plan)["ve-0"]["cores"] == list(range(8)) and engines(plan)["pd-0"]["cores"] == [8, 9, 10, 11]


def test_excluded_and_faulted_cores_are_skipped():
    plan = plan_of({"epd_num_ve": 2, "epd_num_pd": 6, "epd_excluded_cores": ["20-23"]}, faulted={"n1": [4, 5, 6, 7]})
    got = engines(plan)
    assert [got[f"pd-{j}"]["cores"][0] for j in range(6)] == [8, 24, 32, 40, 48, 56]
    assert (got["ve-0"]["cores"], got["ve-1"]["cores"]) == ([0, 1, 2, 3], [16, 17, 18, 19])
    assert plan["n1"]["usable_cores"] == 56
    assert (plan["n1"]["excluded_cores"], plan["n1"]["faulted_cores"]) == ([20, 21, 22, 23], [4, 5, 6, 7])


def test_faulted_cores_come_from_module_result_or_host_facts():
    scan = {"faulted_devices": [0], "faulted_cores": [0, 1, 2, 3]}
    by_result = plan_of({"epd_num_pd": 1}, faulted={"n1": scan})
    by_facts = plan_of({"epd_num_pd": 1, "ansible_facts": {"epd_neuron": scan}})
    assert engines(by_result)["pd-0"]["cores"] == engines(by_facts)["pd-0"]["cores"] == list(range(8, 16))


def test_hand_pinned_slices_keep_their_order_and_ports():
    plan = plan_of({"epd_slices": {"ve": [0, 4], "pd": [24, 8, "48-55"]}})
    got = engines(plan)
    assert [got[f"pd-{j}"]["cores"][0] for j in range(3)] == [24, 8, 48]
    assert [got[f"pd-{j}"]["port"] for j in range(3)] == [18100, 18101, 18102]
    assert got["ve-1"]["side_channel_port"] == 14604


def test_pinned_role_and_planned_role_mix():
    plan = plan_of({"epd_num_ve": 2, "epd_num_pd": 1, "epd_slices": {"pd": [8]}})
    got = engines(plan)
    assert got["pd-0"]["cores"][0] == 8 and [got["ve-0"]["cores"][0], got["ve-1"]["cores"][0]] == [0, 4]


def test_env_and_backend_and_model_kinds():
    sim = engines(plan_of({"epd_num_pd": 1}, epd_engine_backend="sim", epd_compilation_timeout_s=900))["pd-0"]
    real = engines(plan_of({"epd_num_pd": 1}))["pd-0"]
    assert sim["argv"][0] == "epd-sim" and real["argv"][0] == "vllm" and sim["argv"][1:] == real["argv"][1:]
    assert sim["env"]["VLLM_NEURON_COMPILATION_TIMEOUT"] == "900"
    hub = engines(plan_of({"epd_num_pd": 1}, epd_model="Qwen/Qwen3-VL-32B-Instruct"))["pd-0"]
    assert "HF_HUB_OFFLINE" not in hub["env"] and hub["argv"][2] == "Qwen/Qwen3-VL-32B-Instruct"


def test_mxfp8_renders_modules_to_not_convert_in_neuron_config():
    ve = engines(plan_of({"epd_num_ve": 1}, epd_quantization="mxfp8", epd_modules_to_not_convert=["lm_head"]))["ve-0"]
    neuron = json.loads(ve["argv"][ve["argv"].index("--additional-config") + 1])["neuron_config"]
    assert list(neuron) == [
        "quantization",
        "num_batched_tokens_buckets",
        "on_device_sampling_config",
        "modules_to_not_convert",
        "num_seqs_buckets",
    ]
    assert neuron["modules_to_not_convert"] == ["lm_head"] and neuron["quantization"] == "mxfp8"
    bf16 = engines(plan_of({"epd_num_ve": 1}, epd_modules_to_not_convert=["lm_head"]))["ve-0"]
    assert "modules_to_not_convert" not in bf16["argv"][bf16["argv"].index("--additional-config") + 1]


def test_extra_args_go_last_and_string_numbers_are_accepted():
    pd = engines(plan_of({"epd_num_pd": "1"}, epd_extra_args=["--seed", 7], epd_pd_tp="8"))["pd-0"]
    assert pd["argv"][-2:] == ["--seed", "7"] and pd["tp"] == 8


def test_engine_environment_extends_env_and_leaves_argv_alone():
    plain = engines(plan_of({"epd_num_pd": 1}))["pd-0"]
    pd = engines(
        plan_of({"epd_num_pd": 1}, epd_engine_environment={"EPD_SIM_COMPILE_S": 0.5, "NEURON_RT_LOG_LEVEL": "INFO"})
    )["pd-0"]
    assert pd["argv"] == plain["argv"]
    assert pd["env"] == {**plain["env"], "EPD_SIM_COMPILE_S": "0.5", "NEURON_RT_LOG_LEVEL": "INFO"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"FI_EFA_USE_DEVICE_RDMA": "0"}, "epd_engine_environment sets FI_EFA_USE_DEVICE_RDMA: the kit derives it"),
        ({"NEURON_VISIBLE_DEVICES": "0"}, "sets NEURON_VISIBLE_DEVICES: the kit derives it"),
        ({"BAD NAME": "1"}, "'BAD NAME' is not a valid environment variable name"),
        ({"X": "a\nb"}, "epd_engine_environment[X] must be a single line"),
        ({"X": [1]}, "epd_engine_environment[X] must be a string or number"),
        (["X=1"], "epd_engine_environment must be a mapping"),
    ],
)
def test_bad_engine_environment(env, expected):
    assert expected in error_of({"epd_num_pd": 1}, epd_engine_environment=env)


def test_host_without_engines_has_an_empty_plan():
    plan = plan_of(hosts={"n1": {"epd_num_pd": 1}, "n2": {}})
    assert plan["n2"]["engines"] == [] and len(plan["n1"]["engines"]) == 1


def test_settings_filter_exposes_defaults_and_derived_values():
    settings = planner.fleet_settings({"n1": {"epd_model": MODEL}}, ["n1"]).as_dict()
    assert settings["epd_ve_tp"] == 4 and settings["vision_tokens_bucket"] == 30720
    assert settings["executable"] == "vllm" and settings["model_is_local"] is True


def test_plan_table_lists_every_engine():
    hostvars, hosts = load_example("trn2-2e7pd")
    lines = planner.plan_table(planner.plan_from_hostvars(hostvars, hosts))
    assert lines[0].split()[:4] == ["host", "engine", "role", "cores"]
    assert any(line.split()[:5] == ["trn2-node1", "ve-1", "ve", "tp4", "60-63"] for line in lines)
    assert lines[-1].startswith("trn2-node1: 64/64 usable cores")


# --------------------------------------------------------------------------- errors


def test_layout_that_does_not_fit_names_usable_cores_and_what_fits():
    message = error_of({"epd_num_ve": 2, "epd_num_pd": 7, "epd_excluded_cores": [20, 21, 22, 23]})
    assert "n1: layout does not fit: 60 usable cores (of 64; excluded/faulted: 20-23)" in message
    assert "2 VE + 6 PD or 1 VE + 7 PD fit, you asked for 2 VE (tp 4) + 7 PD (tp 8)" in message
    assert "Lower epd_num_ve/epd_num_pd" in message


def test_no_fit_without_exclusions_and_when_one_pool_alone_is_too_big():
    assert "64 usable cores: 0 VE + 8 PD fit, you asked for 0 VE (tp 4) + 9 PD" in error_of({"epd_num_pd": 9})
    message = error_of({"epd_num_ve": 20, "epd_num_pd": 9})
    assert "16 VE + 0 PD or 0 VE + 8 PD fit, you asked for 20 VE" in message
    assert "no engine fits" in error_of({"epd_num_pd": 1, "epd_core_count": 4})


@pytest.mark.parametrize(
    ("slices", "expected"),
    [
        (
            {"pd": [4]},
            "epd_slices.pd[0] = 4 (cores 4-11) is misaligned: a tp=8 slice must start at a multiple of 8 (e.g. 0 or 8)",
        ),
        ({"ve": [2]}, "epd_slices.ve[0] = 2 (cores 2-5) is misaligned"),
        (
            {"pd": [0], "ve": [4]},
            "epd_slices.pd[0] = 0 (cores 0-7) overlaps epd_slices.ve[0] on core 4; slices must be disjoint",
        ),
        ({"pd": [0, 0]}, "overlaps epd_slices.pd[0] on core 0"),
        ({"pd": [64]}, "epd_slices.pd[0] = 64 (cores 64-71) is over budget: the host has 64 cores (0-63)"),
        ({"pd": [16]}, "epd_slices.pd[0] = 16 (cores 16-23) uses unusable cores (excluded 20-23)"),
        (
            {"ve": [[8, 9, 10]]},
            "epd_slices.ve[0] has 3 cores (8-10) but the VE tensor-parallel size is 4: "
            "TP must equal the number of cores",
        ),
        ({"ve": [[8, 9, 10, 12]]}, "is not contiguous"),
        ({"ve": [-4]}, "epd_slices.ve[0] must be >= 0"),
        ({"ve": [True]}, "epd_slices.ve[0] must be an integer, got True (bool)"),
        ({"vision": [0]}, "epd_slices has unknown key(s) vision; use ve and pd"),
        ({"pd": 8}, "epd_slices.pd must be a list of slice starts, got 8 (int)"),
        ([0, 8], "epd_slices must be a mapping like {ve: [0, 4], pd: [8, 16]}"),
    ],
)
def test_bad_hand_pinned_slices(slices, expected):
    assert expected in error_of({"epd_slices": slices, "epd_excluded_cores": ["20-23"]})


def test_pinned_slice_on_a_faulted_core():
    message = error_of({"epd_slices": {"pd": [0]}}, faulted={"n1": [4, 5, 6, 7]})
    assert "uses unusable cores (faulted 4-7)" in message


def test_pinned_count_must_agree_with_the_count():
    assert "epd_num_pd is 7 but epd_slices.pd pins 2 slices" in error_of(
        {"epd_num_pd": 7, "epd_slices": {"pd": [0, 8]}}
    )


@pytest.mark.parametrize(
    ("common", "expected"),
    [
        ({"epd_ve_port_base": 18100}, "port 18100 is used by both epd-pd-0 (HTTP) and epd-ve-0 (HTTP)"),
        (
            {"epd_side_channel_port_base": 18798},
            "port 18800 is used by both the router (epd_router_port) and epd-ve-0 (side channel rank 2)",
        ),
        ({"epd_pd_port_base": 18800}, "port 18800 is used by both the router (epd_router_port) and epd-pd-0 (HTTP)"),
        ({"epd_side_channel_port_base": 65534}, "port 65536 of epd-ve-0 (side channel rank 2) is outside 1024-65535"),
        ({"epd_router_port": 80}, "epd_router_port must be >= 1024, got 80"),
    ],
)
def test_port_collisions(common, expected):
    assert expected in error_of({"epd_num_ve": 1, "epd_num_pd": 1}, **common)


def test_duplicate_engine_ids_are_refused():
    settings = planner.read_settings({"epd_model": MODEL})
    plan = plan_of(
        hosts={
            "n1": {"epd_num_pd": 1, "epd_bind_address": "10.0.0.1"},
            "n2": {"epd_num_pd": 1, "epd_bind_address": "10.0.0.2"},
        }
    )
    plan["n2"]["engines"][0]["engine_id"] = "epd-n1-pd-0"
    with pytest.raises(PlanError, match="duplicate engine id epd-n1-pd-0 on n1 and n2: engine ids key NIXL handshakes"):
        planner.validate_plan(plan, settings)


def test_two_hosts_with_one_address_are_refused():
    hosts = {
        "n1": {"epd_num_pd": 1, "epd_bind_address": "10.0.0.1"},
        "n2": {"epd_num_pd": 1, "epd_bind_address": "10.0.0.1"},
    }
    assert "n2 and n1 both serve http://10.0.0.1:18100: give each host its own epd_bind_address" in error_of(
        hosts=hosts
    )


def test_loopback_in_a_multi_host_fleet_is_refused():
    message = error_of(hosts={"n1": {"epd_num_ve": 1}, "n2": {"epd_num_pd": 1, "epd_bind_address": "10.0.0.2"}})
    assert "n1 binds its engines to 127.0.0.1 in a multi-host fleet" in message


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ["--enable-prefix-caching"],
            "epd_extra_args contains '--enable-prefix-caching': prefix caching must stay off on both pools",
        ),
        (["--enable-prefix-caching=true"], "prefix caching must stay off"),
        (["--mm-encoder-only"], "gives every PD engine both build roles"),
        (["--mm-language-model-only"], "there is no such vllm flag"),
        (["--port", "9000"], "the kit derives --port itself; change epd_ve_port_base / epd_pd_port_base"),
        (["--tensor-parallel-size=2"], "the kit derives --tensor-parallel-size itself"),
        (["--additional-config", "{}"], "the kit derives --additional-config itself"),
        ("--seed 1", "epd_extra_args must be a list of strings, got '--seed 1' (str)"),
        ([["--seed"]], "epd_extra_args[0] must be a string"),
        (["--override-generation-config", '{"a": 1}'], "which is empty or contains whitespace: the engine unit splits"),
        ([""], "which is empty or contains whitespace"),
    ],
)
def test_bad_extra_args(extra, expected):
    assert expected in error_of({"epd_num_pd": 1}, epd_extra_args=extra)


@pytest.mark.parametrize(
    ("common", "expected"),
    [
        ({"epd_model": None}, "epd_model is unset or empty"),
        ({"epd_model": "  "}, "epd_model is unset or empty"),
        ({"epd_model": "./models/x"}, "is a relative path"),
        ({"epd_model": "not a model!"}, "is neither an absolute checkpoint directory nor a Hugging Face id"),
        ({"epd_model": "/models/a\nb"}, "must not contain control characters"),
        ({"epd_model": 7}, "epd_model must be a string, got 7 (int)"),
        ({"epd_pd_tp": "eight"}, "epd_pd_tp must be an integer, got 'eight' (str)"),
        ({"epd_pd_tp": True}, "epd_pd_tp must be an integer, got True (bool)"),
        ({"epd_pd_tp": 6}, "epd_pd_tp must be a power of two"),
        ({"epd_ve_tp": 0}, "epd_ve_tp must be >= 1, got 0"),
        ({"epd_ve_dp": 3}, "epd_ve_dp (3) must divide epd_ve_tp (4)"),
        ({"epd_image_edge": 500}, "epd_image_edge (500) must be a multiple of epd_patch_size (16), e.g. 496"),
        ({"epd_quantization": "fp16"}, "epd_quantization must be one of bf16, mxfp8, got 'fp16'"),
        ({"epd_engine_backend": "docker"}, "epd_engine_backend must be one of vllm, vllm-cpu, sim, got 'docker'"),
        (
            {"epd_engine_backend": "vllm-cpu", "epd_quantization": "mxfp8"},
            "epd_quantization mxfp8 needs epd_engine_backend vllm (Neuron)",
        ),
        ({"epd_engine_id_prefix": "a b"}, "epd_engine_id_prefix must be letters"),
        ({"epd_max_model_len": 0}, "epd_max_model_len must be >= 1"),
        ({"epd_modules_to_not_convert": "lm_head"}, "epd_modules_to_not_convert must be a list of strings"),
    ],
)
def test_bad_global_settings(common, expected):
    assert expected in error_of({"epd_num_pd": 1}, **common)


@pytest.mark.parametrize(
    ("host_vars", "expected"),
    [
        ({"epd_num_pd": -1}, "n1: epd_num_pd must be >= 0, got -1"),
        ({"epd_num_ve": 1.5}, "n1: epd_num_ve must be an integer, got 1.5 (float)"),
        ({"epd_core_count": 0}, "n1: epd_core_count must be >= 1"),
        ({"epd_excluded_cores": [70]}, "n1: epd_excluded_cores lists 70, outside the host's 64 cores (0-63)"),
        ({"epd_excluded_cores": ["23-20"]}, 'range "23-20" runs backwards'),
        ({"epd_excluded_cores": {"a": 1}}, "epd_excluded_cores must be a list of core ids"),
        ({"epd_bind_address": "0.0.0.0"}, "epd_bind_address 0.0.0.0 is a wildcard"),
        ({"epd_bind_address": "bad address"}, "is neither an IP address nor a host name"),
    ],
)
def test_bad_host_variables(host_vars, expected):
    assert expected in error_of(host_vars)


def test_pool_settings_must_agree_across_hosts():
    hosts = {
        "n1": {"epd_pd_tp": 8, "epd_bind_address": "10.0.0.1"},
        "n2": {"epd_pd_tp": 4, "epd_bind_address": "10.0.0.2"},
    }
    assert "epd_pd_tp differs between engine hosts (n1: 8, n2: 4)" in error_of(hosts=hosts)


def test_empty_or_wrong_host_list():
    with pytest.raises(PlanError, match="no engine hosts: add hosts to the epd_engines group"):
        planner.plan_from_hostvars({}, [])
    with pytest.raises(PlanError, match="expects the list of engine hosts"):
        planner.plan_from_hostvars({}, "n1")
    with pytest.raises(PlanError, match="host 'n9' is not in the inventory"):
        planner.plan_from_hostvars({"n1": {"epd_model": MODEL}}, ["n9"])


def test_filter_shims_raise_ansible_filter_error():
    from ansible.errors import AnsibleFilterError

    from tests import repo_modules

    filters = repo_modules.filters().FilterModule().filters()
    assert {"epd_plan", "epd_settings", "epd_router_endpoints", "epd_plan_table", "epd_engine_unit"} <= set(filters)
    with pytest.raises(AnsibleFilterError, match="epd planner: epd_model is unset or empty"):
        filters["epd_plan"]({"n1": {"epd_num_pd": 1}}, ["n1"])
    plan = filters["epd_plan"]({"n1": {"epd_model": MODEL, "epd_num_pd": 1}}, ["n1"])
    assert filters["epd_router_endpoints"](plan)["pd"][0]["url"] == "http://127.0.0.1:18100"


def test_filter_shims_load_the_bundled_planner_without_the_kit(tmp_path):
    """A controller without epd_kit: the filter plugin loads the copy inside the collection."""
    script = (
        "import sys; sys.modules['epd_kit'] = None\n"  # epd_kit is not importable
        "import importlib.util as u\n"
        f"spec = u.spec_from_file_location('f', {str(REPO / 'plugins/filter/epd_kit.py')!r})\n"
        "m = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.plan.__name__, m.plan.serve_argv.__module__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=scaled(60), check=True
    )
    assert result.stdout.split() == ["epd_kit_bundled.plan", "epd_kit_bundled.plan.command"]


# The filter plugin in a controller's Python without the kit: the venv's packages on sys.path as
# a plain directory under `python -S`, so no .pth file runs and the kit's editable install (one)
# does not exist there. Prints what the inventory check says and which modules it loaded.
BUNDLED_CHECK = """
import json, sys
sys.path.append(sys.argv[1])
import importlib.util as u
spec = u.spec_from_file_location("f", sys.argv[2])
m = u.module_from_spec(spec); spec.loader.exec_module(m)
result = m.checked_plan(json.loads(sys.argv[3]), {"epd_engines": ["n1"], "epd_router": ["n1"]})
print(json.dumps({"plan": m.plan.__name__, "problems": result["problems"], "warnings": result["warnings"],
                  "modules": sorted(sys.modules)}))
"""
# what the router's runtime and the preprocessor import; the controller's check needs none of it
HEAVY = ("transformers", "tokenizers", "PIL", "numpy", "aiohttp", "starlette", "torch")
# router_yaml and what it imports, the planner aside: no router runtime, no preprocessor
ROUTER_YAML_CHAIN = ("preprocess", "preprocess.model_files", "preprocess.settings", "router_yaml", "wire")


def controller_site(tmp_path, without: tuple[str, ...] = ()) -> str:
    """A site directory of this venv's packages (links), less the distributions named (import names)."""
    packages = Path(sysconfig.get_paths()["purelib"])
    if not without:
        return str(packages)
    site = tmp_path / "site"
    if site.is_dir():
        return str(site)
    site.mkdir()
    for entry in packages.iterdir():
        if not entry.name.endswith(".pth") and not entry.name.lower().startswith(without):
            (site / entry.name).symlink_to(entry)
    return str(site)


def bundled_check(tmp_path, hostvars, without: tuple[str, ...] = ()) -> dict:
    site = controller_site(tmp_path, without)
    result = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            BUNDLED_CHECK,
            site,
            str(REPO / "plugins/filter/epd_kit.py"),
            json.dumps(hostvars),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def router_hostvars(**router_vars) -> dict:
    return {"n1": {"epd_model": MODEL, "epd_num_pd": 1, "epd_num_ve": 1, **router_vars}}


def test_the_bundled_planner_refuses_a_router_setting_as_the_installed_one_does(tmp_path):
    """A controller without the kit's package but with pydantic (meta/ee-requirements.txt): the
    collection's copy of router_yaml refuses the value with the installed check's very message,
    and the router's runtime and preprocessor stay unimported."""
    from tests import repo_modules

    hostvars = router_hostvars(epd_router_health={"failure_ratio": 1.5}, epd_otlp_traces_endpoint="ftp://t:4318")
    bundled = bundled_check(tmp_path, hostvars)
    assert bundled["plan"] == "epd_kit_bundled.plan" and "epd_kit" not in bundled["modules"]
    installed = repo_modules.filters().checked_plan(hostvars, {"epd_engines": ["n1"], "epd_router": ["n1"]})
    assert bundled["problems"] == installed["problems"] and bundled["warnings"] == installed["warnings"] == []
    assert any(
        p.startswith("n1: epd_router_health.failure_ratio is 1.5: input should be less than or equal to 1")
        for p in bundled["problems"]
    ), bundled["problems"]
    assert any("epd_otlp_traces_endpoint is 'ftp://t:4318'" in p for p in bundled["problems"]), bundled["problems"]
    assert [name for name in bundled["modules"] if name.split(".")[0] in HEAVY] == []
    beside_the_planner = [
        name for name in bundled["modules"] if name.startswith("epd_kit_bundled.") and ".plan" not in name
    ]
    assert sorted(beside_the_planner) == [f"epd_kit_bundled.{name}" for name in ROUTER_YAML_CHAIN]

    passing = bundled_check(tmp_path, router_hostvars(epd_router_health={"failure_ratio": 0.5}))
    assert passing["problems"] == passing["warnings"] == []


def test_the_bundled_planner_without_pydantic_checks_kinds_and_names_the_fix(tmp_path):
    """Without pydantic the router's settings are checked by kind only; the one warning names
    what failed and the command that installs the collection's controller requirements."""
    bundled = bundled_check(tmp_path, router_hostvars(epd_router_health={"failure_ratio": 1.5}), without=("pydantic",))
    assert bundled["problems"] == [] and "pydantic" not in bundled["modules"]
    requirements = REPO / "meta/ee-requirements.txt"
    assert bundled["warnings"] == [
        "the router's settings (epd_router_<section>, epd_router_extra_config) were checked by kind only: "
        "the controller's Python cannot load the router's settings models (No module named 'pydantic'); "
        f"for epd-router check-config's full rules run: {sys.executable} -m pip install -r {requirements}"
    ]
    bad_kind = bundled_check(tmp_path, router_hostvars(epd_router_health=[1]), without=("pydantic",))
    assert bad_kind["problems"], "a value of the wrong kind is still refused"


# --------------------------------------------------------------------------- plan.yml (real ansible-playbook)


def run_plan(inventory, *extra):
    return helpers.playbook(
        "-i",
        str(inventory),
        str(REPO / "playbooks" / "plan.yml"),
        *extra,
        timeout=scaled(120),
        ANSIBLE_STDOUT_CALLBACK="default",
        ANSIBLE_CALLBACK_RESULT_FORMAT="yaml",
    )


@pytest.mark.ansible
@pytest.mark.parametrize(
    ("example", "expected_rows"),
    [
        (
            "single-node-1e1pd",
            [
                "trn2-node1  pd-0    pd tp8  0-7    18100  -             epd-pd-0",
                "trn2-node1  ve-0    ve tp4  8-11   18300  14600-14603   epd-ve-0",
            ],
        ),
        ("trn2-2e7pd", ["pd-6    pd tp8  48-55  18106", "ve-1    ve tp4  60-63  18301  14604-14607   epd-ve-1"]),
        ("multi-node", ["trn2-c  pd-7    pd tp8  56-63  18107", "url: http://10.0.1.31:18303"]),
    ],
)
def test_plan_playbook_prints_the_table(example, expected_rows):
    result = run_plan(EXAMPLES / example)
    assert result.returncode == 0, result.stdout + result.stderr
    for row in expected_rows:
        assert row in result.stdout
    assert "changed=0" in result.stdout and "failed=0" in result.stdout


@pytest.mark.ansible
def test_plan_playbook_fails_with_the_planner_message():
    result = run_plan(EXAMPLES / "trn2-2e7pd", "-e", json.dumps({"epd_plan_faulted": {"trn2-node1": [20, 21, 22, 23]}}))
    assert result.returncode != 0
    output = " ".join((result.stdout + result.stderr).split())
    assert (
        "trn2-node1: layout does not fit: 60 usable cores (of 64; excluded/faulted: 20-23): "
        "2 VE + 6 PD or 1 VE + 7 PD fit" in output
    )
