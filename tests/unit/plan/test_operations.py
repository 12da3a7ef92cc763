"""What the playbooks compute with epd_kit.plan: router.yaml, reachability, engine selection, status."""

import pytest

from epd_kit import plan

MODEL = "/models/Qwen3-VL-32B-Instruct"


def fleet(hosts, **common):
    settings = plan.read_settings({"epd_model": MODEL, **common})
    return plan.plan_fleet(
        settings, [plan.read_host(name, values, settings) for name, values in hosts.items()]
    ), settings


TWO_HOSTS = {
    "a": {"epd_num_ve": 1, "epd_num_pd": 2, "epd_bind_address": "10.0.0.1"},
    "b": {"epd_num_pd": 1, "epd_bind_address": "10.0.0.2"},
}


def test_router_config_takes_model_limits_and_endpoints_from_the_plan():
    fleet_plan, settings = fleet(TWO_HOSTS, epd_quantization="mxfp8", epd_images_per_prompt=4)
    config = plan.router_config(
        fleet_plan,
        settings,
        listen_host="10.0.0.9",
        sections={
            "limits": {"oversized_image": "reject", "images_per_prompt": 99},
            "placement": {"pd_max_inflight": 32},
        },
        draining=["epd-a-pd-1"],
        extra={"placement": {"queue_size": 8}, "auth": {"protect_pools": False}},
    )
    assert list(config) == [
        "listen",
        "dtype",
        "handoff",
        "front_checks",
        "timeouts",
        "limits",
        "media",
        "health",
        "placement",
        "retries",
        "auth",
        "engine_auth",
        "admin",
        "models",
    ]
    [model] = config["models"]
    assert (model["name"], model["model"], model["quantization"], config["listen"]) == (
        MODEL,
        MODEL,
        "mxfp8",
        {"host": "10.0.0.9", "port": 18800},
    )
    # the fleet's limits; the model's image limits are its entry's, over the fleet's (one place each)
    assert config["limits"] == {"oversized_image": "reject", "images_per_prompt": 99}
    assert model["limits"] == {"images_per_prompt": 4, "max_image_patches": 1024}
    assert model["endpoints"] is not None
    assert config["placement"] == {"pd_max_inflight": 32, "queue_size": 8}
    assert config["dtype"] == "bfloat16"  # the engines' --dtype
    assert config["handoff"] == "ec_locator"  # Neuron 2.32's vLLM 0.24.0 (Settings.handoff)
    assert config["auth"] == {"enabled": False, "protect_pools": False}  # no keys: off, said outright
    assert config["engine_auth"] == {"key_file": None}  # the role passes epd_engine_key_file
    # loopback and the router's own address: the kit's drain and rollout calls come from the host
    assert config["admin"] == {"networks": ["127.0.0.0/8", "::1/128", "10.0.0.9/32"], "token_file": None}
    assert [(e["id"], e["state"]) for e in model["endpoints"]["pd"]] == [
        ("epd-a-pd-0", "active"),
        ("epd-a-pd-1", "draining"),
        ("epd-b-pd-0", "active"),
    ]
    assert model["endpoints"]["ve"] == [{"id": "epd-a-ve-0", "url": "http://10.0.0.1:18300", "state": "active"}]
    config = plan.router_config(fleet_plan, plan.read_settings({"epd_model": MODEL}), listen_host="h")
    assert config["models"][0]["quantization"] is None
    assert plan.router_config(fleet_plan, settings, listen_host="h", served_model_name="v")["models"][0]["name"] == "v"


def test_router_defaults_agree_with_the_planner():
    """The router's own defaults for what the plan sets are the planner's (one list of defaults)."""
    from epd_kit.router_yaml import RouterConfig

    config = RouterConfig.model_validate(
        {
            "model": MODEL,
            "endpoints": {
                "ve": [{"id": "epd-ve-0", "url": "http://127.0.0.1:18300"}],
                "pd": [{"id": "epd-pd-0", "url": "http://127.0.0.1:18100"}],
            },
        }
    )
    settings = plan.read_settings({"epd_model": MODEL})
    lane = config.lane_config(MODEL)
    assert lane.limits.images_per_prompt == config.limits.images_per_prompt == settings.images_per_prompt
    assert lane.limits.max_image_patches == config.limits.max_image_patches == settings.vision_attention_block_size
    assert config.listen.port == settings.router_port


def test_unreachable_engines_of_a_loopback_host():
    fleet_plan, _ = fleet({"h1": {"epd_num_pd": 1}})
    assert plan.unreachable_engines(fleet_plan, ["h1"]) == []
    assert plan.unreachable_engines(fleet_plan, ["r1"]) == [
        "router host r1 cannot reach the engines of h1 on 127.0.0.1"
    ]
    remote, _ = fleet(TWO_HOSTS)
    assert plan.unreachable_engines(remote, ["r1"]) == []


def test_engine_selection_takes_instances_and_engine_ids():
    assert plan.engine_selection(" pd-0, epd-ve-1,,x-pd-12 ,bogus") == ["pd-0", "ve-1", "pd-12", "bogus"]
    assert plan.engine_selection(None) == plan.engine_selection("") == []
    files = ["/etc/epd/engines/pd-1.env", "/etc/epd/engines/ve-0.env", "/etc/epd/engines/pd-0.env"]
    assert plan.deployed_engines(files) == ["pd-0", "pd-1", "ve-0"]
    assert plan.deployed_engines(files, "epd-pd-1,ve-9") == ["pd-1"]
    # with several engine hosts, an id selects only on the host whose label it carries
    assert plan.deployed_engines(files, "epd-n1-pd-1,ve-0", "n1") == ["pd-1", "ve-0"]
    assert plan.deployed_engines(files, "epd-n1-pd-1,ve-0", "n2") == ["ve-0"]


def test_rolling_queue_is_in_plan_order_and_refuses_unknown_engines():
    fleet_plan, _ = fleet(TWO_HOSTS)
    queue = plan.rolling_queue(fleet_plan)
    assert [(q["host"], q["instance"], q["engine_id"]) for q in queue] == [
        ("a", "pd-0", "epd-a-pd-0"),
        ("a", "pd-1", "epd-a-pd-1"),
        ("a", "ve-0", "epd-a-ve-0"),
        ("b", "pd-0", "epd-b-pd-0"),
    ]
    assert [(q["host"], q["instance"]) for q in plan.rolling_queue(fleet_plan, "epd-b-pd-0, ve-0")] == [
        ("a", "ve-0"),
        ("b", "pd-0"),
    ]
    assert [q["engine_id"] for q in plan.rolling_queue(fleet_plan, "pd-0")] == ["epd-a-pd-0", "epd-b-pd-0"]
    with pytest.raises(plan.EpdPlanError, match="unknown engines pd-7, epd-pd-0; planned are epd-a-pd-0, epd-a-pd-1"):
        plan.rolling_queue(fleet_plan, "pd-7,pd-0,epd-pd-0")


def test_status_rows_and_table():
    rows = plan.status_rows(
        "n1",
        ["pd-0", "ve-0"],
        ["active", "failed", "active"],
        [{"status": 200}, {"status": -1, "msg": "refused"}],
        {"status": 503},
    )
    assert rows == [
        ["n1", "epd-engine@pd-0.service", "active", "ok"],
        ["n1", "epd-engine@ve-0.service", "failed", "down (-1)"],
        ["n1", "epd-router.service", "active", "not ready (503)"],
    ]
    assert plan.status_rows("r1", [], [], [], {"skipped": True}) == [
        ["r1", "epd-router.service", "?", "not ready (-1)"]
    ]
    assert plan.status_rows("n2", [], [], []) == [["n2", "-", "no EPD units", "-"]]
    table = plan.status_table({"n1": rows}, ["n1", "n3"], ["n1", "r9"])
    assert table[0].split() == ["HOST", "UNIT", "STATE", "HEALTH"]
    assert table[1] == f"{'n1':<24} {'epd-engine@pd-0.service':<30} {'active':<12} ok"
    assert [line.split()[:3] for line in table[4:]] == [["n3", "-", "unreachable"], ["r9", "-", "unreachable"]]


def test_read_env_file_reads_what_the_env_template_writes():
    text = '# header\nA=\'{"k": 1}\'\nB="it\'s \\$HOME \\"q\\""\nEPD_HEALTH_URL=\'http://127.0.0.1:18100/health\'\n'
    assert plan.read_env_file(text) == {
        "A": '{"k": 1}',
        "B": 'it\'s $HOME "q"',
        "EPD_HEALTH_URL": "http://127.0.0.1:18100/health",
    }


def test_router_config_auth_follows_the_api_keys_file_and_parses():
    from epd_kit.router_yaml import parse_config

    fleet_plan, settings = fleet(TWO_HOSTS)
    with_keys = plan.router_config(fleet_plan, settings, listen_host="10.0.0.9", api_keys_file="/etc/epd/keys")
    without = plan.router_config(fleet_plan, settings, listen_host="10.0.0.9")
    assert with_keys["auth"] == {"api_keys_file": "/etc/epd/keys"}
    assert without["auth"] == {"enabled": False}
    assert not parse_config(without).auth.on
    assert parse_config(without).dtype == "bfloat16"
