"""Tenants (router/tenants.py): the tenants file and its errors, the buckets (requests per
second, concurrent requests, tokens per minute charged after the answer, images per minute)
with Retry-After computed from them, the table shared by a host's processes through one
file, limits kept across a reload, and `epd-router check-config` on a tenant typo."""

from __future__ import annotations

import math

import pytest
import yaml
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from epd_kit.router.auth import KeyFileError
from epd_kit.router.cli import main
from epd_kit.router.errors import RouterError
from epd_kit.router.service import RouterService
from epd_kit.router.tenant_table import BucketTable, TableFault
from epd_kit.router.tenants import (
    TenantLimits,
    TenantMetrics,
    TenantQuotas,
    load_client_keys,
    parse_tenants,
)
from epd_kit.router_yaml import parse_config

GOOD = """\
# tenants of the fleet
tenant acme requests_per_s=2 concurrent_requests=8 tokens_per_min=600 images_per_min=3   # the big one
tenant beta
key acme sk-acme-1
key acme sk-acme-2#with-a-hash
key beta sk-beta
"""


def test_a_tenants_file_gives_each_key_its_tenant_and_each_tenant_its_limits():
    parsed = parse_tenants(GOOD, "f")
    assert parsed.tenants == {
        "acme": TenantLimits(requests_per_s=2, concurrent_requests=8, tokens_per_min=600, images_per_min=3),
        "beta": TenantLimits(),
    }
    assert parsed.keys == (b"sk-acme-1", b"sk-acme-2#with-a-hash", b"sk-beta")
    assert parsed.owners == ("acme", "acme", "beta")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (GOOD + "key acmee sk-x\n", "f: line 7: tenant 'acmee' is not defined in this file (defined: acme, beta)"),
        ("tenant a tokens_per_minute=5\nkey a k\n", "line 1: unknown limit 'tokens_per_minute'"),
        ("tenant a tokens_per_min=5.5\nkey a k\n", "line 1: tokens_per_min='5.5' is not an integer"),
        ("tenant a requests_per_s=0\nkey a k\n", "line 1: requests_per_s must be above 0"),
        ("tenant a requests_per_s=nan\nkey a k\n", "line 1: requests_per_s must be above 0"),
        ("tenant a\ntenant a\nkey a k\n", "line 2: tenant 'a' is defined twice"),
        ("tenant a\nkey a k\nkey a k\n", "line 3: the same key as line 2"),
        ("tenant a\nkey a two words\n", "line 2: expected 'key TENANT KEY' (a key has no spaces)"),
        ("tenant a/b\nkey a/b k\n", "line 1: tenant name 'a/b' must be"),
        ("tenant a\n", "f: contains no keys"),
        ("sk-plain-key\n", "line 1: unknown entry 'sk-plain-key'"),
        # values the router could not serve (issue 58): 1e-320 made every request a 500, 1e-300
        # a Retry-After of 300 digits (measured on 676bde9)
        (
            "tenant acme requests_per_s=1e-320\nkey acme k\n",
            "line 1: tenant 'acme': requests_per_s=1e-320 is outside the range the router serves, 0.001 to 1e+06",
        ),
        ("tenant a requests_per_s=1e-300\nkey a k\n", "tenant 'a': requests_per_s=1e-300 is outside"),
        ("tenant a requests_per_s=2000000\nkey a k\n", "tenant 'a': requests_per_s=2000000 is outside"),
        ("tenant a concurrent_requests=2000000\nkey a k\n", "concurrent_requests=2000000 is outside the range"),
        ("tenant a tokens_per_min=10000000000000\nkey a k\n", "tokens_per_min=10000000000000 is outside"),
        ("tenant a images_per_min=10000000000\nkey a k\n", "images_per_min=10000000000 is outside the range"),
    ],
)
def test_a_bad_tenants_file_is_refused_naming_its_line_and_never_a_key(text, error):
    with pytest.raises(KeyFileError) as info:
        parse_tenants(text, "f")
    assert error in str(info.value)
    assert "sk-x" not in str(info.value) and "two words" not in str(info.value)


def test_the_tenants_file_may_be_the_kits_0640_not_world_readable(tmp_path):
    path = tmp_path / "tenants"
    path.write_text(GOOD)
    path.chmod(0o640)
    checker, tenants = load_client_keys(None, path)
    assert checker.check("Bearer sk-beta") == "beta" and tenants is not None
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 640"):
        load_client_keys(None, path)


def test_plain_keys_and_tenant_keys_together(tmp_path):
    plain = tmp_path / "keys"
    plain.write_text("sk-plain\n")
    plain.chmod(0o600)
    tenants = tmp_path / "tenants"
    tenants.write_text(GOOD)
    tenants.chmod(0o640)
    checker, _ = load_client_keys(plain, tenants)
    assert checker.check("Bearer sk-plain") is None  # a key of api_keys_file has no tenant
    assert checker.check("Bearer sk-acme-2#with-a-hash") == "acme"
    with pytest.raises(RouterError) as info:
        checker.check("Bearer sk-nobody")
    assert info.value.status == 401
    tenants.write_text(GOOD + "key beta sk-plain\n")
    with pytest.raises(KeyFileError, match="a key is also in api_keys_file"):
        load_client_keys(plain, tenants)


def quotas(table: BucketTable | None = None, worker: int = 0) -> TenantQuotas:
    return TenantQuotas(table or BucketTable(), worker, TenantMetrics(CollectorRegistry()))


def refused(call) -> RouterError:
    with pytest.raises(RouterError) as info:
        call()
    assert info.value.status == 429 and info.value.type == "rate_limit_error"
    return info.value


async def arefused(call) -> RouterError:
    with pytest.raises(RouterError) as info:
        await call
    assert info.value.status == 429 and info.value.type == "rate_limit_error"
    return info.value


def test_requests_per_second_refill_and_retry_after():
    q, limits = quotas(), TenantLimits(requests_per_s=2)
    q.admit("a", limits, now=100.0)
    q.admit("a", limits, now=100.0)  # a burst of one second's worth
    err = refused(lambda: q.admit("a", limits, now=100.0))
    assert err.retry_after == 1 and "2 requests per second" in err.message
    q.admit("a", limits, now=100.5)  # half a second refills one


def test_the_bounds_are_one_definition_for_check_config_and_the_planner(tmp_path, config):
    from epd_kit.plan.tenants import tenant_problems
    from epd_kit.plan.tenants_format import BOUNDS

    inventory = {
        "epd_router_tenants": {"acme": {"requests_per_s": 1e-320}, "beta": {"tokens_per_min": 10}},
        "epd_router_tenant_keys": [{"tenant": "acme", "key": "sk-1"}],
    }
    low, high = BOUNDS["requests_per_s"]
    expected = f"tenant 'acme': requests_per_s=1e-320 is outside the range the router serves, {low:g} to {high:g}"
    assert tenant_problems(inventory) == [f"epd_router_tenants.acme: {expected} (leave it out for no limit)"]
    tenants = tmp_path / "tenants"
    tenants.write_text("tenant acme requests_per_s=1e-320\nkey acme sk-1\n")
    tenants.chmod(0o640)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(config(auth={"tenants_file": str(tenants)})))
    res = CliRunner().invoke(main, ["check-config", str(path)])
    assert res.exit_code == 1 and f"tenants_file {tenants}: line 1: {expected}" in res.output
    # the ends of each range are served
    for name, (low, high) in BOUNDS.items():
        for value in (low, high):
            text = f"tenant a {name}={value if name == 'requests_per_s' else int(value)}\nkey a k\n"
            assert getattr(parse_tenants(text, "f").tenants["a"], name) == value


def test_retry_after_never_passes_its_documented_ceiling():
    from epd_kit.plan.tenants_format import RETRY_AFTER_MAX_S

    q = quotas()
    slowest = TenantLimits(requests_per_s=0.001)  # the smallest rate: one request per 1000 s
    q.admit("a", slowest, now=0.0)
    assert refused(lambda: q.admit("a", slowest, now=0.0)).retry_after == 1000
    tiny = TenantLimits(tokens_per_min=1)
    q.admit("b", tiny, now=0.0).finish(10**9, now=0.0)  # a debt of 10^9 minutes
    assert refused(lambda: q.admit("b", tiny, now=0.0)).retry_after == RETRY_AFTER_MAX_S == 3600
    q.admit("b", tiny, now=3600.0)  # honoured, it is admitted: the debt was kept within the ceiling


def test_tokens_are_charged_after_the_answer_and_retry_after_lifts_the_debt():
    q, limits = quotas(), TenantLimits(tokens_per_min=600)  # 10 a second
    ticket = q.admit("a", limits, now=0.0)
    ticket.finish(1000, now=0.0)  # the answer was bigger than the quota: the level goes to -400
    ticket.finish(1000, now=0.0)  # charged once
    err = refused(lambda: q.admit("a", limits, now=0.0))
    assert err.retry_after == math.ceil(401 / 10)
    refused(lambda: q.admit("a", limits, now=err.retry_after - 1.0))
    q.admit("a", limits, now=float(err.retry_after))  # honoured, it is admitted


def test_concurrent_requests_are_given_back_as_they_end():
    q, limits = quotas(), TenantLimits(concurrent_requests=2)
    first, _ = q.admit("a", limits), q.admit("a", limits)
    assert refused(lambda: q.admit("a", limits)).retry_after == 1
    first.finish(0)
    q.admit("a", limits)


def test_images_per_minute():
    q, limits = quotas(), TenantLimits(images_per_min=3)  # one every 20 s
    ticket = q.admit("a", limits, now=0.0)
    q.take_images(ticket, 2, now=0.0)
    err = refused(lambda: q.take_images(ticket, 2, now=0.0))
    assert err.retry_after == 20
    q.take_images(ticket, 2, now=20.0)
    with pytest.raises(RouterError) as info:  # can never fit: the client's to fix
        q.take_images(ticket, 4, now=1000.0)
    assert info.value.status == 400 and "at most 3 per minute" in info.value.message


def test_a_refused_request_costs_nothing_and_tenants_are_apart():
    q = quotas()
    limits = TenantLimits(requests_per_s=1, concurrent_requests=5)
    q.admit("a", limits, now=0.0)
    for _ in range(5):
        refused(lambda: q.admit("a", limits, now=0.0))
    assert q.table.concurrent(q.table.slot("a")) == 1  # the refusals took no place
    q.admit("b", limits, now=0.0)  # another tenant's buckets are its own
    q.admit("a", limits, now=1.0)


def test_the_processes_of_a_host_share_one_table(tmp_path):
    path = tmp_path / "tenant-buckets.bin"
    one, two = quotas(BucketTable(path), 0), quotas(BucketTable(path), 1)
    limits = TenantLimits(concurrent_requests=2, tokens_per_min=60)
    one.admit("a", limits, now=0.0)
    held = two.admit("a", limits, now=0.0)
    refused(lambda: one.admit("a", limits, now=0.0))  # the other process's request counts
    held.finish(100, now=0.0)  # charged in process two, refused in process one
    assert refused(lambda: one.admit("a", limits, now=0.0)).retry_after == 41
    # worker 0 restarts (it may have been killed): its places are given back, the levels kept
    restarted = quotas(BucketTable(path), 0)
    assert restarted.table.concurrent(restarted.table.slot("a")) == 0
    assert refused(lambda: restarted.admit("a", limits, now=0.0)).retry_after == 41


async def test_a_reload_keeps_the_buckets_and_applies_new_limits(tmp_path, config, char_renderer):
    tenants = tmp_path / "tenants"
    tenants.write_text("tenant a requests_per_s=1\nkey a sk-a\n")
    tenants.chmod(0o640)
    path = tmp_path / "r.yaml"
    cfg = config(auth={"tenants_file": str(tenants)})
    path.write_text(yaml.safe_dump(cfg))
    svc = RouterService(parse_config(cfg), char_renderer(), config_path=path)
    assert svc.auth.check("Bearer sk-a") == "a"
    await svc.tenants.admit("a")
    await arefused(svc.tenants.admit("a"))
    tenants.write_text("tenant a requests_per_s=1 images_per_min=5\ntenant b\nkey a sk-a\nkey b sk-b2\n")
    assert svc.reload()  # a rotation: new key, new limit, no restart
    assert svc.auth.check("Bearer sk-b2") == "b"
    await arefused(svc.tenants.admit("a"))  # the level survived the reload
    samples = {
        (s.labels["tenant"], s.labels["limit"]): s.value
        for s in svc.metrics.registry.collect()
        for s in s.samples
        if s.name == "epd_router_tenant_limit"
    }
    assert samples == {("a", "requests_per_s"): 1, ("a", "images_per_min"): 5}
    refused_total = svc.metrics.registry.get_sample_value(
        "epd_router_tenant_requests_total", {"tenant": "a", "result": "refused"}
    )
    assert refused_total == 2
    tenants.write_text("tenant a\nkey aa sk-a\n")  # a typo: the running keys stay
    assert not svc.reload() and svc.auth.check("Bearer sk-b2") == "b"
    await svc.stop()


def test_check_config_names_the_line_of_a_tenant_typo(tmp_path, config):
    tenants = tmp_path / "tenants"
    tenants.write_text("tenant acme\nkey acme sk-1\nkey acm sk-2\n")
    tenants.chmod(0o640)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(config(auth={"tenants_file": str(tenants)})))
    res = CliRunner().invoke(main, ["check-config", str(path)])
    assert res.exit_code == 1
    assert f"tenants_file {tenants}: line 3: tenant 'acm' is not defined" in res.output
    assert "sk-2" not in res.output


def test_a_table_of_configured_tenants_keeps_their_slots_and_no_process_keeps_a_stale_slot(tmp_path):
    from epd_kit.plan.tenants_format import MAX_TENANTS
    from epd_kit.router.tenant_table import TABLE_FILE

    path = tmp_path / TABLE_FILE
    one, two = BucketTable(path), BucketTable(path)
    configured = [f"t{i}" for i in range(MAX_TENANTS)]
    with one.locked():
        for name in configured:
            one.slot(name, configured)
    with two.locked():
        cached = two.slot("t0", configured)
    reloaded = ["renamed", *configured[1:]]  # a reload renamed t0
    with one.locked():
        one.free_others(reloaded)  # t0's slot is free
        fresh = one.slot("renamed", reloaded)  # a 257th name takes t0's slot, and only it
        assert one.slot("t1", reloaded) != fresh
    assert fresh == cached
    with two.locked():  # the other process, reloaded too, looks its tenants up again
        with pytest.raises(TableFault, match="full"):
            two.slot("t0", reloaded)  # no longer configured: no slot (its cached one is taken)
        assert two.slot("t1", reloaded) == one.slot("t1", reloaded)
