"""epd_engine_backend vllm-cpu: the plan renders the Neuron command less what only Neuron reads plus
what a CPU engine needs (epd_kit/plan/backends.py CPU_FLAGS, CPU_ENVIRONMENT), from the shipped
sandbox inventory, and refuses what cannot work on CPU."""

from __future__ import annotations

import json

import pytest

from epd_kit import plan as planner
from epd_kit.plan.backends import LOCATOR_SCHEDULER
from epd_kit.plan.errors import EpdPlanError
from tests.ansible.helpers import REPO, inventory_hostvars

INVENTORY = REPO / "inventory/sandbox/vllm-cpu"


@pytest.fixture(scope="module")
def engines():
    hostvars, groups = inventory_hostvars(INVENTORY)
    fleet = planner.plan_from_hostvars(hostvars, groups["epd_engines"])
    return {e["instance"]: e for e in fleet["n1"]["engines"]}


def test_the_ve_runs_the_neuron_argv_less_neuron_plus_cpu(engines):
    ve = engines["ve-0"]
    config = ve["argv"][ve["argv"].index("--additional-config") + 1]
    ec_config = ve["argv"][ve["argv"].index("--ec-transfer-config") + 1]
    assert ve["argv"] == [
        "epd-vllm", "serve", "/models/tiny-qwen3-vl", "--tensor-parallel-size", "1",
        "--host", "127.0.0.1", "--port", "18300", "--max-model-len", "8192",
        "--max-num-batched-tokens", "8192", "--max-num-seqs", "1", "--dtype", "bfloat16",
        "--limit-mm-per-prompt", '{"image": 30}', "--no-enable-prefix-caching",
        "--mm-encoder-only", "--no-async-scheduling",
        "--scheduler-cls", "epd_vllm_plugin.scheduler.ECLocatorScheduler",
        "--enforce-eager", "--skip-mm-profiling",
        "--additional-config", config, "--ec-transfer-config", ec_config,
        "--load-format", "dummy",
    ]  # fmt: skip
    ec = json.loads(ve["argv"][ve["argv"].index("--ec-transfer-config") + 1])
    assert ec == {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_producer",
        "engine_id": "epd-ve-0",
        "ec_connector_extra_config": {
            "shared_storage_path": "/var/cache/epd/ec-store",
            "side_channel_host": "127.0.0.1",
            "side_channel_port": 14600,
        },
    }


def test_the_pd_has_no_locator_scheduler_and_reads_the_same_store(engines):
    pd = engines["pd-0"]
    assert "--scheduler-cls" not in pd["argv"]
    assert pd["argv"][pd["argv"].index("--no-enable-prefix-caching") + 1 :][:5] == [
        "--mm-processor-cache-gb", "0", "--enforce-eager", "--skip-mm-profiling", "--additional-config",
    ]  # fmt: skip
    ec = json.loads(pd["argv"][pd["argv"].index("--ec-transfer-config") + 1])
    assert ec["ec_connector_extra_config"] == {"shared_storage_path": "/var/cache/epd/ec-store"}
    assert ec["ec_role"] == "ec_consumer"


def test_each_engine_on_its_own_cpu_with_its_own_cache_and_nothing_of_neuron(engines):
    assert engines["pd-0"]["env"] == {
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_CACHE_ROOT": "~/vllm-cpu/epd-pd-0",
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "6000",
        "VLLM_ENGINE_READY_TIMEOUT_S": "6300",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TORCH_COMPILE_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    assert engines["ve-0"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert engines["ve-0"]["env"]["VLLM_CACHE_ROOT"] == "~/vllm-cpu/epd-ve-0"


def test_the_unit_env_file_expands_to_the_plans_argv(engines):
    for engine in engines.values():
        unit = planner.engine_unit(engine, "/opt/epd/vllm-cpu/bin/epd-vllm", 600)
        assert unit["argv"] == ["/opt/epd/vllm-cpu/bin/epd-vllm", *engine["argv"][1:]]
        assert unit["env_file"]["VLLM_CPU_OMP_THREADS_BIND"] == engine["env"]["VLLM_CPU_OMP_THREADS_BIND"]
        assert unit["env_file"]["EPD_ROLE_ARGS"].split()[-2:] == ["--enforce-eager", "--skip-mm-profiling"]


def test_a_tensor_parallel_engine_binds_one_cpu_list_per_rank():
    settings = planner.read_settings({"epd_model": "/m", "epd_engine_backend": "vllm-cpu"})
    assert planner.engine_env(settings, [8, 9, 10, 11], "epd-ve-0")["VLLM_CPU_OMP_THREADS_BIND"] == "8|9|10|11"


def test_the_operator_may_size_the_kv_cache_but_not_move_the_cores():
    common = {"epd_model": "/m", "epd_engine_backend": "vllm-cpu"}
    sized = planner.read_settings({**common, "epd_engine_environment": {"VLLM_CPU_KVCACHE_SPACE": "8"}})
    assert planner.engine_env(sized, [0], "e")["VLLM_CPU_KVCACHE_SPACE"] == "8"
    with pytest.raises(EpdPlanError, match="epd_engine_environment sets VLLM_CPU_OMP_THREADS_BIND"):
        planner.read_settings({**common, "epd_engine_environment": {"VLLM_CPU_OMP_THREADS_BIND": "0"}})


def test_a_vllm_cpu_fleet_on_two_engine_hosts_is_refused_naming_the_store():
    common = {"epd_model": "/m", "epd_engine_backend": "vllm-cpu", "epd_ve_tp": 1, "epd_ve_dp": 1, "epd_pd_tp": 1}
    hostvars = {
        "a": {**common, "epd_num_ve": 1, "epd_bind_address": "10.0.0.1"},
        "b": {**common, "epd_num_pd": 1, "epd_bind_address": "10.0.0.2"},
    }
    with pytest.raises(
        EpdPlanError, match=r"epd_engine_backend vllm-cpu runs engines on one host.*epd_vllm_cpu_ec_dir"
    ):
        planner.plan_from_hostvars(hostvars, ["a", "b"])
    # the same fleet on vllm plans
    neuron = {h: {**v, "epd_engine_backend": "vllm"} for h, v in hostvars.items()}
    assert planner.plan_from_hostvars(neuron, ["a", "b"])
    # ... and on vllm-cpu with the kit's NIXL connector
    nixl = {h: {**v, "epd_vllm_cpu_ec_transport": "nixl"} for h, v in hostvars.items()}
    assert planner.plan_from_hostvars(nixl, ["a", "b"])


def test_neuron_stays_the_default_and_its_command_is_unchanged():
    settings = planner.read_settings({"epd_model": "/m"})
    assert settings.engine_backend == "vllm" and settings.executable == "vllm"
    argv = planner.serve_argv(settings, "ve", "epd-ve-0", "127.0.0.1", 18300, 14600)
    assert "--scheduler-cls" not in argv and "--enforce-eager" not in argv
    assert json.loads(argv[-1])["ec_connector"] == "NeuronNixlECConnector"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in planner.engine_env(settings, [0, 1, 2, 3])


def nixl_fleet(**extra):
    common = {
        "epd_model": "/m",
        "epd_engine_backend": "vllm-cpu",
        "epd_vllm_cpu_ec_transport": "nixl",
        "epd_ve_tp": 1,
        "epd_ve_dp": 1,
        "epd_pd_tp": 1,
        **extra,
    }
    hostvars = {
        "a": {**common, "epd_num_ve": 1, "epd_bind_address": "10.0.0.1"},
        "b": {**common, "epd_num_pd": 1, "epd_bind_address": "10.0.0.2"},
    }
    fleet = planner.plan_from_hostvars(hostvars, ["a", "b"])
    return fleet["a"]["engines"][0], fleet["b"]["engines"][0]


def test_the_nixl_transport_names_the_kits_connector_and_ucx_over_tcp():
    ve, pd = nixl_fleet()
    for engine, role in ((ve, "ve"), (pd, "pd")):
        ec = json.loads(engine["argv"][engine["argv"].index("--ec-transfer-config") + 1])
        assert ec["ec_connector"] == "EPDNixlECConnector"
        assert ec["ec_connector_module_path"] == "epd_vllm_plugin.nixl_connector"
        assert ec["ec_role"] == ("ec_producer" if role == "ve" else "ec_consumer")
        extra = ec["ec_connector_extra_config"]
        assert extra["backends"] == ["UCX"] and extra["ucx_address"] == engine["url"].split("//")[1].split(":")[0]
        assert "shared_storage_path" not in extra
        # both pools run the kit's scheduler: the VE's locators, the PD's failed loads
        assert engine["argv"][engine["argv"].index("--scheduler-cls") + 1] == LOCATOR_SCHEDULER
        assert engine["env"]["UCX_TLS"] == "tcp" and engine["env"]["UCX_TCP_PORT_RANGE"] == "14700-14763"
    ve_extra = json.loads(ve["argv"][ve["argv"].index("--ec-transfer-config") + 1])["ec_connector_extra_config"]
    assert (ve_extra["side_channel_host"], ve_extra["side_channel_port"]) == ("10.0.0.1", 14600)


def test_the_shared_dir_transport_keeps_its_command():
    settings = planner.read_settings({"epd_model": "/m", "epd_engine_backend": "vllm-cpu"})
    assert settings.vllm_cpu_ec_transport == "shared-dir"
    argv = planner.serve_argv(settings, "pd", "epd-pd-0", "127.0.0.1", 18100, None)
    assert "--scheduler-cls" not in argv and json.loads(argv[-1])["ec_connector"] == "ECExampleConnector"
    assert not any(k.startswith("UCX_") for k in planner.engine_env(settings, [0], "epd-pd-0"))


@pytest.mark.parametrize("bad", ["14700", "80-90", "14763-14700", "a-b"])
def test_a_bad_ucx_port_range_is_refused(bad):
    with pytest.raises(EpdPlanError, match="epd_vllm_cpu_ucx_port_range must be a port range"):
        planner.read_settings({"epd_model": "/m", "epd_vllm_cpu_ucx_port_range": bad})


def test_an_unknown_transport_is_refused():
    with pytest.raises(EpdPlanError, match="epd_vllm_cpu_ec_transport must be shared-dir or nixl"):
        planner.read_settings({"epd_model": "/m", "epd_vllm_cpu_ec_transport": "rdma"})


def test_the_three_host_real_engine_sandbox_plans_nixl_across_hosts():
    """inventory/sandbox/vllm-cpu-three-host: VE on n1, PD on n2, the router on n3; the PD reads
    the VE's blocks over NIXL, so n1 opens its side channel and UCX ports to n2 only."""
    from epd_kit.plan import firewall
    from epd_kit.plan.variables import VARIABLES

    hostvars, groups = inventory_hostvars(REPO / "inventory/sandbox/vllm-cpu-three-host")
    result = planner.check_inventory(hostvars, groups, None, set(VARIABLES))
    assert result["problems"] == []
    fleet = result["plan"]
    (ve,) = fleet["n1"]["engines"]
    (pd,) = fleet["n2"]["engines"]
    assert (ve["role"], pd["role"]) == ("ve", "pd")
    # the test hosts share the machine's CPUs: the VE and the PD on one core starved UCX's progress
    # (issue 54), so each has a core of its own, as vLLM's CPU worker binds it
    assert (ve["cores"], pd["cores"]) == ([0], [1])
    assert (ve["env"]["VLLM_CPU_OMP_THREADS_BIND"], pd["env"]["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert not fleet.get("n3", {}).get("engines")  # the router host runs no engine
    for engine in (ve, pd):
        ec = json.loads(engine["argv"][engine["argv"].index("--ec-transfer-config") + 1])
        assert ec["ec_connector"] == "EPDNixlECConnector"
    n1 = firewall.firewall_for(fleet, result["settings"]["epd_router_port"], hostvars, groups, "n1", None)
    ucx = [r for r in n1["rules"] if r["what"].startswith("UCX")]
    assert len(ucx) == 1 and ucx[0]["sources"] == ["10.213.0.12"] and ucx[0]["ports"] == [*range(14700, 14764)]
