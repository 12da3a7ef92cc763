"""Prometheus scrape targets from the plan (epd_kit.plan.observability)."""

from epd_kit.plan import observability, plan_from_hostvars

MODEL = "/models/Qwen3-VL-32B-Instruct"


def hostvars(**hosts):
    return {name: {"epd_model": MODEL, **values} for name, values in hosts.items()}


def plan_of(inventory):
    engine_hosts = [h for h, v in inventory.items() if v.get("epd_num_ve") or v.get("epd_num_pd")]
    return plan_from_hostvars(inventory, engine_hosts)


def files(inventory, routers=("r",), port=18800):
    return observability.scrape_files(plan_of(inventory), inventory, list(routers), port)


TWO_HOSTS = hostvars(
    a={"epd_num_ve": 1, "epd_num_pd": 2, "epd_bind_address": "10.0.0.1"},
    b={"epd_num_pd": 1, "epd_bind_address": "10.0.0.2"},
    r={"epd_bind_address": "0.0.0.0", "ansible_host": "10.0.0.9"},
)


def test_every_engine_and_router_is_a_target_with_its_labels():
    out = files(TWO_HOSTS)
    engines = out["jobs"][observability.ENGINES_JOB]
    planned = [(name, e) for name, host_plan in plan_of(TWO_HOSTS).items() for e in host_plan["engines"]]
    assert engines == [
        {
            "targets": [f"{e['host']}:{e['port']}"],
            "labels": {"host": name, "role": e["role"], "engine_id": e["engine_id"], "instance": e["instance"]},
        }
        for name, e in planned
    ]
    assert sorted(t for e in engines for t in e["targets"]) == [
        "10.0.0.1:18100",
        "10.0.0.1:18101",
        "10.0.0.1:18300",
        "10.0.0.2:18100",
    ]
    # a wildcard bind is dialled on the host's inventory address
    assert out["jobs"][observability.ROUTER_JOB] == [
        {
            "targets": ["10.0.0.9:18800"],
            "labels": {"host": "r", "role": "router", "engine_id": "", "instance": "router"},
        }
    ]
    assert out["loopback"] == []


def test_engines_removed_from_the_inventory_disappear():
    fewer = {**TWO_HOSTS, "a": {**TWO_HOSTS["a"], "epd_num_pd": 1}}
    fewer.pop("b")
    after = files(fewer)["jobs"][observability.ENGINES_JOB]
    assert sorted((e["labels"]["host"], e["labels"]["role"]) for e in after) == [("a", "pd"), ("a", "ve")]
    assert [t for e in after for t in e["targets"]] == [
        f"{e['host']}:{e['port']}" for e in plan_of(fewer)["a"]["engines"]
    ]


def test_router_listen_host_wins_and_loopback_targets_are_reported():
    one = hostvars(n1={"epd_num_ve": 1, "epd_num_pd": 1, "epd_router_listen_host": "10.213.0.11"})
    out = files(one, routers=("n1",), port=18900)
    assert out["jobs"][observability.ROUTER_JOB][0]["targets"] == ["10.213.0.11:18900"]
    assert [t["instance"] for t in out["loopback"]] == ["pd-0", "ve-0"]  # engines stay on 127.0.0.1


def test_ipv6_addresses_are_bracketed():
    six = hostvars(h={"epd_num_pd": 1, "epd_bind_address": "fd00::5"})
    assert files(six, routers=())["jobs"][observability.ENGINES_JOB][0]["targets"] == ["[fd00::5]:18100"]
