"""What a deploy against a running fleet rolls: engines whose effective command, environment or
unit changed (not the stagger or the start timeout), engines it drains before they stop, and
the exact selection it hands to the batch planner."""

from pathlib import Path

import jinja2
import pytest

from epd_kit import plan

REPO = Path(__file__).resolve().parents[3]
MODEL = "/models/Qwen3-VL-32B-Instruct"
ENV_TEMPLATE = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True).from_string(
    (REPO / "templates/epd-engine.env.j2").read_text()
)


def fleet(**settings) -> dict:
    """Hosts a (1 VE, 2 PD) and b (1 VE, 2 PD), TP 4."""
    read = plan.read_settings({"epd_model": MODEL, "epd_pd_tp": 4, **settings})
    hosts = [
        plan.read_host(name, {"epd_num_ve": 1, "epd_num_pd": 2, "epd_bind_address": f"10.0.0.{i}"}, read)
        for i, name in enumerate(("a", "b"), 1)
    ]
    return plan.plan_fleet(read, hosts)


def env_files(fleet_plan: dict, host: str) -> dict[str, dict[str, str]]:
    host_plan = fleet_plan[host]
    return {
        e["instance"]: plan.engine_unit(e, "/venv/bin/vllm", host_plan["start_timeout_s"])["env_file"]
        for e in host_plan["engines"]
    }


def deployed(fleet_plan: dict, host: str) -> dict[str, str]:
    """The env files as the template writes them on the host."""
    out = {}
    for engine in fleet_plan[host]["engines"]:
        unit = plan.engine_unit(engine, "/venv/bin/vllm", fleet_plan[host]["start_timeout_s"])
        out[engine["instance"]] = ENV_TEMPLATE.render(
            ansible_managed="Ansible managed", engine=engine, epd_engine_unit=unit
        )
    return out


UNIT = "# Ansible managed\n[Service]\nExecStart=/venv/bin/vllm serve\nTimeoutStartSec={}\nLimitNOFILE=65536\n"


def test_the_same_plan_changes_nothing():
    now = fleet()
    assert (
        plan.rollout.changed_engines(env_files(now, "a"), deployed(now, "a"), UNIT.format(600), UNIT.format(600)) == []
    )


def test_the_stagger_and_the_start_timeout_restart_nothing():
    before, after = fleet(epd_start_stagger_s=10), fleet(epd_start_stagger_s=90)
    assert deployed(before, "a") != deployed(after, "a")  # the env files do change (EPD_START_DELAY_S)
    changed = plan.rollout.changed_engines(
        env_files(after, "a"), deployed(before, "a"), UNIT.format(6790), UNIT.format(6630)
    )
    assert changed == []


def test_a_pd_setting_changes_every_pd_and_no_ve():
    before, after = fleet(), fleet(epd_max_num_seqs=4)
    assert plan.rollout.changed_engines(env_files(after, "b"), deployed(before, "b"), UNIT, UNIT) == ["pd-0", "pd-1"]


def test_an_effective_unit_change_changes_every_deployed_engine_and_new_ones_are_not_changes():
    now = fleet()
    on_host = deployed(now, "a")
    del on_host["pd-1"]  # not deployed yet: it starts, it does not roll
    new_unit = UNIT.replace("65536", "131072")
    assert plan.rollout.changed_engines(env_files(now, "a"), on_host, new_unit, UNIT) == ["pd-0", "ve-0"]
    assert plan.rollout.changed_engines(env_files(now, "a"), on_host, new_unit, None) == []


def test_engines_the_router_serves_but_the_plan_dropped_drain_in_their_pool():
    now = fleet()
    pools = [
        {"id": "epd-a-pd-0", "url": "http://10.0.0.1:18100", "role": "pd", "state": "active"},
        {"id": "epd-a-pd-2", "url": "http://10.0.0.1:18102", "role": "pd", "state": "active"},
        {"id": "epd-old-ve-0", "url": "http://10.0.0.9:18300", "role": "ve", "state": "removed"},
    ]
    retire = plan.rollout.retiring_endpoints(now, pools)
    assert retire["retiring"] == ["epd-a-pd-2"]
    config = plan.router_config(
        now, plan.read_settings({"epd_model": MODEL, "epd_pd_tp": 4}), listen_host="h", retiring=retire["engines"]
    )
    endpoints = config["models"][0]["endpoints"]
    assert endpoints["pd"][-1] == {"id": "epd-a-pd-2", "url": "http://10.0.0.1:18102", "state": "draining"}
    assert endpoints["pd"][:-1] == plan.router_endpoints(now)["pd"]
    assert endpoints["ve"] == plan.router_endpoints(now)["ve"]


def test_a_host_mapping_rolls_exactly_its_instances_and_an_empty_one_rolls_nothing():
    now = fleet()
    batches, _ = plan.rollout_batches(now, {"a": ["pd-1"], "b": ["pd-0", "pd-1"]}, batch={"pd": 2})
    assert [[e["engine_id"] for e in b.engines] for b in batches] == [["epd-a-pd-1", "epd-b-pd-0"], ["epd-b-pd-1"]]
    assert plan.rollout_plan(now, {"a": [], "b": []})["batches"] == []
    with pytest.raises(plan.EpdPlanError, match="pd-7 on a"):
        plan.rollout_batches(now, {"a": ["pd-7"]})
