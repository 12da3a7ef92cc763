"""A PD that could not read a VE's blocks (ECLoadFailure, which kills the
PD's engine core, docs/contract.md §3.5) charges and quarantines that VE, the request moves
to another PD only with blocks of another VE a PD has read from, and at most once."""

from __future__ import annotations

import pytest

from epd_kit.router.context import RequestContext
from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import parse_request
from tests.unit.router.test_router_generation import (
    EC_LOAD,
    ENGINE_DEAD,
    Engines,
    all_slots_free,
    answer,
    make_service,  # noqa: F401  (the fixture)
)


def ve_of(service, mm_hash: str, engines: Engines) -> str:
    return next(ve for ve, hashes in reversed(engines.encodes) if mm_hash in hashes)


async def test_the_ve_is_charged_quarantined_and_avoided(make_service):  # noqa: F811
    engines = Engines()
    service = await make_service(engines)
    assert await answer(service, False) == "Hi"
    bad = ve_of(service, "h1", engines)  # the PD names h1 (EC_LOAD)
    engines.pd_failures.append(("http", 500, EC_LOAD))
    assert await answer(service, False) == "Hi"
    ve = service.state.pools.by_id()[bad]
    snap = ve.snapshot()
    assert not ve.eligible and snap["healthy"] is False and snap["failures"] == 1 and snap["quarantined_s"] > 50
    quarantines = service.metrics.registry.get_sample_value("epd_router_engine_quarantines_total", {"engine": bad})
    assert quarantines == 1
    # the other VE was not charged; later requests encode on it alone
    other = next(e for e in service.state.pools.ve if e.id != bad)
    assert other.eligible and other.failures == 0
    engines.encodes.clear()
    assert await answer(service, True) == "Hi"
    assert {ve for ve, _ in engines.encodes} == {other.id}
    assert all_slots_free(service)


async def test_no_retry_onto_blocks_no_pd_has_read(make_service):  # noqa: F811
    """A cold router: the VE the items move to is unproven, so the request fails with the
    PD's error instead of risking a second PD."""
    engines = Engines(pd_failures=[("http", 500, EC_LOAD)])
    service = await make_service(engines)
    with pytest.raises(RouterError) as info:
        await answer(service, False)
    assert info.value.status == 502 and "ECLoadFailure" in info.value.message
    assert len(engines.pd_calls) == 1
    assert all_slots_free(service)


@pytest.mark.parametrize(
    "said", [(EC_LOAD, EC_LOAD.replace("h1", "h2")), (ENGINE_DEAD, ENGINE_DEAD)], ids=["ec-load", "engine-dead"]
)
async def test_a_second_failed_read_ends_the_retries(make_service, said):  # noqa: F811
    engines = Engines()
    service = await make_service(engines, max_attempts=3)
    assert await answer(service, False) == "Hi"
    engines.pd_calls.clear()
    engines.pd_failures += [("http", 500, message) for message in said]
    with pytest.raises(RouterError):
        await answer(service, False)
    assert len(engines.pd_calls) == 2  # not a third PD, though max_attempts allows it
    assert all_slots_free(service)


async def test_blocks_of_a_ve_quarantined_after_the_encode_go_to_no_pd(make_service):  # noqa: F811
    """Another request found the VE's blocks unreadable while this one was between its
    encode and its PD call: its items are encoded again elsewhere first."""
    engines = Engines()
    service = await make_service(engines)
    assert await answer(service, False) == "Hi"
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}], "stream": False})
    ctx = RequestContext.start(chat, "rid2", service.state.cfg)
    await service.generation.prepare(ctx)
    bad = ctx.encoded_by["h1"]
    service.state.pools.by_id()[bad].blocks_unreadable("test")
    engines.pd_calls.clear()
    result = await service.generation._on_a_pd(
        ctx,
        stream=False,
        call=lambda pd, body: service.engines.generate(pd, body, len(ctx.token_ids), None, lambda r: r),
        keep_slot=False,
    )
    ctx.release_encoders()
    assert result.choices[0].token_ids == [72, 105]
    (call,) = engines.pd_calls
    assert {loc["engine_id"] for loc in call.locators.values()} == {e.id for e in service.state.pools.ve} - {bad}
    assert all_slots_free(service)


async def test_the_last_ve_in_service_is_charged_but_not_quarantined(make_service):  # noqa: F811
    """A read can fail for a cause that is not the VE's (a timeout on a loaded PD): with the
    other VE already quarantined, the last one stays in service, so image requests still run."""
    engines = Engines()
    service = await make_service(engines)
    assert await answer(service, False) == "Hi"
    first = ve_of(service, "h1", engines)
    service.state.pools.by_id()[first].blocks_unreadable("test")
    engines.encodes.clear()
    assert await answer(service, False) == "Hi"  # encoded on the other VE alone
    (last,) = {ve for ve, _ in engines.encodes}
    assert last != first
    engines.pd_failures.append(("http", 500, EC_LOAD))
    await answer(service, False)
    ve = service.state.pools.by_id()[last]
    assert ve.failures == 1 and not ve.quarantined and ve.snapshot()["quarantined_s"] == 0
    quarantines = service.metrics.registry.get_sample_value("epd_router_engine_quarantines_total", {"engine": last})
    assert quarantines is None
    assert all_slots_free(service)
