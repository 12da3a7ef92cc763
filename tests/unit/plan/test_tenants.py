"""The router's tenants file from the inventory (plan/tenants.py): the text the role renders
parses into the same tenants and keys with the router's own parser, and the inventory check
refuses what the router would, naming the inventory entry (a tenant typo in a key's entry, an
unknown limit) and never a key, before any host is touched."""

from __future__ import annotations

import pytest

from epd_kit import plan as planner
from epd_kit.plan.tenants import tenant_problems, tenants_file_text
from epd_kit.plan.tenants_format import TenantLimits, parse_tenants
from epd_kit.plan.variables import VARIABLES

TENANTS = {"acme": {"tokens_per_min": 200000, "concurrent_requests": 8}, "beta": None}
KEYS = [{"tenant": "acme", "key": "sk-acme-secret-0001"}, {"tenant": "beta", "key": "sk-beta-secret-0001"}]


def test_the_rendered_file_is_what_the_router_reads():
    parsed = parse_tenants(tenants_file_text(TENANTS, KEYS), "f")
    assert parsed.tenants == {
        "acme": TenantLimits(tokens_per_min=200000, concurrent_requests=8),
        "beta": TenantLimits(),
    }
    assert parsed.keys == (b"sk-acme-secret-0001", b"sk-beta-secret-0001") and parsed.owners == ("acme", "beta")


@pytest.mark.parametrize(
    ("tenants", "keys", "problem"),
    [
        (
            TENANTS,
            [*KEYS, {"tenant": "acmee", "key": "sk-typo-secret"}],
            "epd_router_tenant_keys[2]: tenant 'acmee' is not defined in epd_router_tenants (defined: acme, beta)",
        ),
        ({"acme": {"tokens_per_minute": 5}}, KEYS[:1], "epd_router_tenants.acme: unknown limit 'tokens_per_minute'"),
        (
            TENANTS,
            [*KEYS, {"tenant": "beta", "key": "sk-acme-secret-0001"}],
            "epd_router_tenant_keys[0] (tenant acme) and epd_router_tenant_keys[2] (tenant beta) hold the same key: "
            "a key belongs to one tenant; remove the stale entry",
        ),
        (
            {"acme corp": {"tokens_per_min": 5}},
            [{"tenant": "acme corp", "key": "sk-acme-secret-0001"}],
            "epd_router_tenants.acme corp: the tenant name 'acme corp' must be 1-63 characters of [A-Za-z0-9_.-]",
        ),
        (TENANTS, [{"tenant": "acme"}], "epd_router_tenant_keys[0] must be {tenant: NAME, key: KEY}"),
        (TENANTS, "sk-acme-secret-0001", "epd_router_tenant_keys must be a list of {tenant: NAME, key: KEY}, got str"),
        (TENANTS, [{"tenant": "acme", "key": "two words"}], "epd_router_tenant_keys[0]: expected 'key TENANT KEY'"),
    ],
)
def test_the_inventory_check_names_the_entry_and_never_a_key(tenants, keys, problem):
    problems = tenant_problems({"epd_router_tenants": tenants, "epd_router_tenant_keys": keys})
    assert len(problems) == 1 and problems[0].startswith(problem), problems
    assert "secret" not in problems[0] and "two words" not in problems[0]


def test_a_key_list_of_the_wrong_kind_is_named_once_without_its_value():
    engine = {"epd_model": "/models/m", "epd_num_ve": 1, "epd_num_pd": 1, "epd_bind_address": "10.0.0.1"}
    hostvars = {"n1": {**engine, "epd_router_tenants": TENANTS, "epd_router_tenant_keys": "sk-x-secret"}}
    result = planner.check_inventory(hostvars, {"epd_engines": ["n1"], "epd_router": ["n1"]}, None, set(VARIABLES))
    assert result["problems"] == ["epd_router_tenant_keys must be a list of {tenant: NAME, key: KEY}, got str"]


def test_check_inventory_refuses_a_tenant_typo_before_any_host():
    engine = {"epd_model": "/models/m", "epd_num_ve": 1, "epd_num_pd": 1, "epd_bind_address": "10.0.0.1"}
    tenants = {
        "epd_router_tenants": TENANTS,
        "epd_router_tenant_keys": [{"tenant": "acm", "key": "sk-x-secret-0123456789"}],
    }
    hostvars = {"n1": {**engine, **tenants}}
    result = planner.check_inventory(hostvars, {"epd_engines": ["n1"], "epd_router": ["n1"]}, None, set(VARIABLES))
    assert result["plan"] is None
    assert result["problems"] == [
        "epd_router_tenant_keys[0]: tenant 'acm' is not defined in epd_router_tenants (defined: acme, beta)"
    ]
    hostvars["n1"]["epd_router_tenant_keys"] = KEYS
    assert (
        planner.check_inventory(hostvars, {"epd_engines": ["n1"], "epd_router": ["n1"]}, None, set(VARIABLES))[
            "problems"
        ]
        == []
    )


def test_router_config_names_the_tenants_file():
    from epd_kit.router_yaml import parse_config
    from tests.unit.plan.test_operations import TWO_HOSTS, fleet

    fleet_plan, settings = fleet(TWO_HOSTS)
    cfg = planner.router_config(fleet_plan, settings, listen_host="10.0.0.9", tenants_file="/etc/epd/tenants")
    assert cfg["auth"] == {"tenants_file": "/etc/epd/tenants"}
    assert parse_config(cfg).auth.on


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        (
            {"epd_router_tenant_keys": [{"tenant": "acme", "key": "sk-1"}]},
            "epd_router_tenant_keys[0]: the key has 4 characters, fewer than 16: a client key is all that stands "
            "between the client networks and the fleet, and a short one is guessed; make one with: "
            "openssl rand -hex 24",
        ),
        (
            {"epd_router_api_key": "aaaaaaaaaaaaaaaaaaaa"},
            "epd_router_api_key: the key has only 1 different characters (fewer than 8): a placeholder or a pattern, "
            "not a secret; make one with: openssl rand -hex 24",
        ),
    ],
)
def test_a_weak_client_key_is_refused_by_its_entry_never_shown(values, problem):
    from epd_kit.plan.tenants import key_strength_problems

    assert key_strength_problems(values) == [problem]
    assert key_strength_problems({"epd_router_tenant_keys": KEYS, "epd_router_api_key": "3f9c1b2e7d4a60c8"}) == []
