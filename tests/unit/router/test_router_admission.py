"""PD admission: least outstanding under the cap, the bounded wait queue, 429/503 with
Retry-After, and the queue on its own."""

from __future__ import annotations

import asyncio
import time

import pytest

from epd_kit.router.admission import RECHECK_S, PdAdmission, WaitQueue
from epd_kit.router.config import parse_config
from epd_kit.router.errors import RouterError, UpstreamError
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.pools import build_pools
from epd_kit.router.state import RouterState


@pytest.fixture
def state(config) -> RouterState:
    cfg = parse_config(config(placement={"pd_max_inflight": 1, "queue_size": 1, "queue_timeout_s": 0.3}))
    state = RouterState(cfg, build_pools(cfg)[0])
    for e in state.pools.all():
        e.healthy = True
    return state


@pytest.fixture
def admission(state) -> PdAdmission:
    return PdAdmission(state, RouterMetrics(lambda: state.pools))


async def test_cap_queue_and_429(admission):
    a = await admission.acquire(set(), None)
    b = await admission.acquire(set(), None)
    assert {a.id, b.id} == {"epd-pd-0", "epd-pd-1"}  # least outstanding spreads
    waiter = asyncio.create_task(admission.acquire(set(), None))  # queued (queue_size 1)
    await asyncio.sleep(0.05)
    assert admission.queue.waiting == 1
    with pytest.raises(RouterError) as full:
        await admission.acquire(set(), None)
    assert full.value.status == 429 and full.value.retry_after and "wait queue is full" in full.value.message
    await admission.release(a)
    c = await asyncio.wait_for(waiter, 1)
    assert c is a and a.inflight == 1 and admission.queue.waiting == 0
    with pytest.raises(RouterError) as timed_out:
        await admission.acquire(set(), None)
    assert timed_out.value.status == 429 and "waited 0.3s" in timed_out.value.message
    assert admission.queue.waiting == 0


async def test_no_healthy_pd_is_503_not_429(state, admission):
    for e in state.pools.pd:
        e.healthy = False
    with pytest.raises(RouterError) as info:
        await admission.acquire(set(), None)
    assert info.value.status == 503 and info.value.retry_after >= 1
    assert "no healthy active PD (2 configured)" in info.value.message
    assert not state.ready


async def test_no_pd_left_to_try_raises_the_last_failure(admission):
    last = UpstreamError(502, "generate on PD epd-pd-1 failed", engine_id="epd-pd-1", stage="generate",
                         engine_failed=True, retry_other=True)
    with pytest.raises(UpstreamError) as info:
        await admission.acquire({"epd-pd-0", "epd-pd-1"}, last)
    assert info.value is last
    picked = await admission.acquire({"epd-pd-0"}, last)
    assert picked.id == "epd-pd-1"


async def test_a_waiter_sees_a_pd_come_back_without_a_notify(state, admission):
    for e in state.pools.pd:
        e.inflight = 1  # both at the cap
    state.pools.pd[1].healthy = False
    waiter = asyncio.create_task(admission.acquire(set(), None))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    state.pools.pd[1].inflight = 0
    state.pools.pd[1].healthy = True  # a health probe does not notify the queue
    t = time.monotonic()
    engine = await asyncio.wait_for(waiter, 1)
    assert engine.id == "epd-pd-1" and time.monotonic() - t <= RECHECK_S + 0.1


async def test_wait_queue_is_bounded():
    queue = WaitQueue()
    assert queue.try_enter(2) and queue.try_enter(2)
    assert not queue.try_enter(2) and queue.waiting == 2
    queue.leave()
    assert queue.try_enter(2)
    assert not queue.try_enter(0)


async def test_wait_queue_wakes_every_waiter_or_times_out():
    queue = WaitQueue()
    t = time.monotonic()
    await queue.wait(0.05)  # nobody wakes it: returns after the timeout
    assert time.monotonic() - t >= 0.05
    waiters = [asyncio.create_task(queue.wait(5)) for _ in range(3)]
    await asyncio.sleep(0.02)
    await queue.wake_all()
    done, pending = await asyncio.wait(waiters, timeout=1)
    assert len(done) == 3 and not pending
