"""Router hosts alike (plan/alike.py): a setting that decides a request's answer, differing between
router hosts, is refused naming the hosts and what differs, never a key; what tunes one host passes."""

from __future__ import annotations

from epd_kit import plan as planner
from epd_kit.plan.variables import VARIABLES

KEY = "sk-acme-3f9c1b2e7d4a60c8"


def check(r1: dict, r2: dict) -> dict:
    engine = {"epd_model": "/models/m", "epd_num_ve": 1, "epd_num_pd": 1, "epd_bind_address": "10.0.0.1"}
    router = {"epd_model": "/models/m", "ansible_host": "10.0.0.2", "epd_bind_address": "10.0.0.2"}
    hostvars = {"n1": {**engine, **r1}, "r2": {**router, **r2}}
    groups = {"epd_engines": ["n1"], "epd_router": ["n1", "r2"]}
    return planner.check_inventory(hostvars, groups, None, set(VARIABLES))


def alike(result: dict) -> list[str]:
    return [p for p in result["problems"] if "[router-hosts-alike:" in p]


def test_tenant_keys_on_one_router_are_refused_by_count_never_by_key():
    keys = {"epd_router_tenants": {"acme": {}}, "epd_router_tenant_keys": [{"tenant": "acme", "key": KEY}]}
    problems = alike(check(keys, {}))
    assert len(problems) == 2, problems  # the tenants and their keys, each named
    assert problems[1].startswith(
        "epd_router_tenant_keys differs between the router hosts (n1: 1 key(s): acme 1, r2: unset)"
    )
    assert not any(KEY in p for p in problems)


def test_settings_of_one_host_may_differ_and_equal_ones_pass():
    tuned = {"epd_router_workers": 4, "epd_router_timeouts": {"total_s": 1200}, "epd_router_health": {"interval_s": 5}}
    limits = {"epd_router_limits": {"max_image_bytes": 1000000}, "epd_router_served_model_name": "vision"}
    assert alike(check({**tuned, **limits}, limits)) == []


def test_an_extra_config_section_that_decides_answers_is_compared_too():
    problems = alike(check({"epd_router_extra_config": {"media": {"allow_http": True}}}, {}))
    assert problems and problems[0].startswith(
        "epd_router_extra_config.media differs between the router hosts (allow_http: n1 True, r2 unset)"
    )
