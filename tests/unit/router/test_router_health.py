"""Outlier ejection and readmission (router/health.py): streaks and failure ratio, connect
timeouts that never empty a pool, refused connections, and engines ejected as hung that only
a serving probe brings back."""

from __future__ import annotations

import pytest

from epd_kit.router.errors import Failure
from epd_kit.router.health import EngineHealth
from epd_kit.router.pools import build_pools
from epd_kit.router.state import RouterState
from epd_kit.router_yaml import parse_config


@pytest.fixture
def state(config) -> RouterState:
    cfg = parse_config(config(health={"failure_threshold": 2, "failure_ratio": 0.5, "ratio_window": 10}))
    state = RouterState(cfg, build_pools(cfg)[0])
    for e in state.pools.all():
        e.healthy = True
    return state


@pytest.fixture
def rules(state) -> EngineHealth:
    return EngineHealth(lambda: state.cfg.health, lambda: state.pools)


def test_consecutive_failures_eject_and_a_success_resets_the_streak(state, rules):
    pd = state.pools.pd[0]
    rules.call_failed(pd, Failure.error, "HTTP 500")
    rules.call_succeeded(pd)
    rules.call_failed(pd, Failure.error, "HTTP 500")
    assert pd.healthy
    rules.call_failed(pd, Failure.error, "HTTP 500")
    assert not pd.healthy and pd.failures == 3 and pd.last_error == "HTTP 500"


def test_a_failure_ratio_ejects_an_engine_that_fails_every_other_call(state, rules):
    pd = state.pools.pd[0]
    for _ in range(2):
        rules.call_failed(pd, Failure.error, "HTTP 502")
        rules.call_succeeded(pd)
    assert pd.healthy  # 2 of 4: fewer than half the window seen
    rules.call_failed(pd, Failure.error, "HTTP 502")
    assert not pd.healthy  # 3 of 5 failed


def test_a_refused_connection_ejects_at_once(state, rules):
    """Nothing listened: the process died, and the one that answers next is a restarted, cold
    engine: back only once a serving probe (a real tiny encode) answered, not at /health's 200."""
    ve = state.pools.ve[0]
    rules.call_failed(ve, Failure.refused, "ConnectError")
    assert not ve.healthy and ve.needs_serving_probe
    for _ in range(3):
        rules.probe_result(ve, True, "/health: HTTP 200")
    assert not ve.healthy
    rules.serving_probe_result(ve, True, "serving probe answered")
    assert ve.healthy and not ve.needs_serving_probe


def test_connect_timeouts_never_eject_the_last_eligible_engine_of_a_pool(state, rules):
    pd0, pd1 = state.pools.pd
    for pd in (pd0, pd1):  # a burst: both PDs see connect timeouts
        for _ in range(3):
            rules.call_failed(pd, Failure.connect_timeout, "ConnectTimeout")
    assert [pd0.healthy, pd1.healthy] == [False, True]  # the second is the last one: kept
    ve = state.pools.ve[0]  # a pool of one
    for _ in range(5):
        rules.call_failed(ve, Failure.connect_timeout, "ConnectTimeout")
    assert ve.healthy
    rules.call_failed(ve, Failure.error, "HTTP 500")  # evidence beyond connect timeouts
    assert not ve.healthy


def test_probes_eject_and_readmit(state, rules):
    ve = state.pools.ve[0]
    rules.probe_result(ve, False, "/health: ReadTimeout")
    assert ve.healthy
    rules.probe_result(ve, False, "/health: ReadTimeout")
    assert not ve.healthy
    rules.probe_result(ve, True, "/health: HTTP 200")
    assert ve.healthy and ve.call_failures == 0 and ve.outcomes == []


def test_an_engine_ejected_as_hung_needs_a_serving_probe(state, rules):
    """Timeouts of real calls eject it; its /health keeps answering 200, which must not bring
    it back; only a successful serving probe does."""
    ve = state.pools.ve[0]
    for _ in range(2):
        rules.call_failed(ve, Failure.timeout, "no answer within 10.0s")
    assert not ve.healthy and ve.needs_serving_probe
    for _ in range(5):
        rules.probe_result(ve, True, "/health: HTTP 200")
    assert not ve.healthy
    rules.serving_probe_result(ve, False, "serving probe: timed out")
    assert not ve.healthy and ve.needs_serving_probe
    rules.serving_probe_result(ve, True, "serving probe answered")
    assert ve.healthy and not ve.needs_serving_probe
    assert ve.snapshot()["needs_serving_probe"] is False


def test_an_immediate_probe_that_finds_the_engine_gone_ejects_it(state, rules):
    pd = state.pools.pd[1]
    rules.probe_definitive(pd, "/health: ConnectError")
    assert not pd.healthy and pd.failures == 1
