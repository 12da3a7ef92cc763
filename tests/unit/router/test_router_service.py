"""The service object: reload semantics (atomic swap, engines keep their state, a bad file
changes nothing) and drain."""

from __future__ import annotations

import asyncio

import yaml

from epd_kit.router.service import RouterService
from epd_kit.router_yaml import parse_config


async def test_reload_drains_adds_and_keeps_engine_state(tmp_path, config, char_renderer):
    path = tmp_path / "r.yaml"
    cfg = config(placement={"pd_max_inflight": 8})
    path.write_text(yaml.safe_dump(cfg))
    svc = RouterService(parse_config(cfg), char_renderer(), config_path=path)
    for e in svc.state.pools.all():
        e.healthy = True
    held = await svc.admission.acquire(set(), None)
    cfg["endpoints"]["pd"][0]["state"] = "draining"
    path.write_text(yaml.safe_dump(cfg))
    assert svc.reload()
    picks = {(await svc.admission.acquire(set(), None)).id for _ in range(5)}
    assert picks == {"epd-pd-1"}
    # engines survive the reload with their counters: in-flight work is still accounted
    pd0 = svc.state.pools.by_id()["epd-pd-0"]
    assert pd0.inflight == (1 if held.id == "epd-pd-0" else 0)
    cfg["endpoints"]["pd"].append({"id": "epd-pd-2", "url": "http://127.0.0.1:4"})
    path.write_text(yaml.safe_dump(cfg))
    assert svc.reload()
    added = svc.state.pools.by_id()["epd-pd-2"]
    assert added.healthy is False  # unknown until its first probe answers
    assert svc.state.pools.by_id()["epd-pd-1"].healthy is True  # survivors keep their state
    path.write_text("endpoints: [")
    assert not svc.reload()
    assert svc.state.pools.by_id()["epd-pd-0"].state.value == "draining"


async def test_reload_keeps_restart_only_settings(tmp_path, config, char_renderer):
    path = tmp_path / "r.yaml"
    cfg = config(limits={"max_image_pixels": 1000})
    path.write_text(yaml.safe_dump(cfg))
    svc = RouterService(parse_config(cfg), char_renderer(), config_path=path)
    cfg["limits"]["max_image_pixels"] = 2000
    cfg["placement"] = {"pd_max_inflight": 3}
    path.write_text(yaml.safe_dump(cfg))
    assert svc.reload()
    assert svc.state.cfg.limits.max_image_pixels == 1000  # baked into the preprocessor
    assert svc.state.cfg.placement.pd_max_inflight == 3


async def test_drain_turns_ready_off_and_waits_for_requests(config, char_renderer):
    svc = RouterService(parse_config(config()), char_renderer())
    for e in svc.state.pools.all():
        e.healthy = True
    assert svc.state.ready
    svc.begin_request()
    svc.begin_drain()
    assert not svc.state.ready and svc.state.not_ready_reason() == "router is shutting down"
    assert not await svc.wait_idle(0.05)
    asyncio.get_running_loop().call_later(0.05, svc.end_request)
    assert await svc.wait_idle(1)


async def test_a_reload_drops_api_keys_only_when_told_to(tmp_path, config, char_renderer, caplog):
    keys = tmp_path / "keys"
    keys.write_text("sk-1\n")
    keys.chmod(0o600)
    path = tmp_path / "r.yaml"
    cfg = config(auth={"api_keys_file": str(keys)})
    path.write_text(yaml.safe_dump(cfg))
    svc = RouterService(parse_config(cfg), char_renderer(), config_path=path)
    assert svc.auth.enabled
    for auth in ({}, {"protect_metrics": False}):  # the section missing, or keys missing
        cfg["auth"] = auth
        path.write_text(yaml.safe_dump(cfg))
        assert not svc.reload()
        assert svc.auth.enabled
        assert "would turn API-key authentication off" in caplog.records[-1].error
    del cfg["auth"]
    path.write_text(yaml.safe_dump(cfg))
    assert not svc.reload() and svc.auth.enabled
    cfg["auth"] = {"enabled": False}
    path.write_text(yaml.safe_dump(cfg))
    assert svc.reload()
    assert not svc.auth.enabled and "turns API-key authentication off" in caplog.text
    assert svc.metrics.registry.get_sample_value("epd_router_config_reloads_total", {"result": "error"}) == 3
