"""PD admission: least outstanding under the cap, the bounded wait queue, 429/503 with
Retry-After, and the queue on its own."""

from __future__ import annotations

import asyncio
import time

import pytest

from epd_kit.router.admission import RECHECK_S, PdAdmission
from epd_kit.router.errors import Failure, RouterError, UpstreamError
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.pools import build_pools
from epd_kit.router.state import RouterState
from epd_kit.router_yaml import parse_config


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
    last = UpstreamError(
        502,
        "generate on PD epd-pd-1 failed",
        engine_id="epd-pd-1",
        stage="generate",
        failure=Failure.error,
        retry_other=True,
    )
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


@pytest.fixture
def fifo_state(config) -> RouterState:
    cfg = parse_config(config(placement={"pd_max_inflight": 1, "queue_size": 8, "queue_timeout_s": 5}))
    state = RouterState(cfg, build_pools(cfg)[0])
    for e in state.pools.all():
        e.healthy = True
    return state


async def test_freed_slots_go_to_waiters_in_arrival_order_never_to_a_newcomer(fifo_state):
    admission = PdAdmission(fifo_state, RouterMetrics(lambda: fifo_state.pools))
    held = [await admission.acquire(set(), None) for _ in range(2)]  # both PDs full
    order: list[str] = []
    done = asyncio.Event()  # every client holds its slot until then

    async def client(name: str) -> None:
        engine = await admission.acquire(set(), None)
        order.append(name)
        await done.wait()
        await admission.release(engine)

    waiters = []
    for name in ("a", "b", "c"):
        waiters.append(asyncio.create_task(client(name)))
        await asyncio.sleep(0.01)  # arrival order a, b, c
    assert admission.queue.waiting == 3
    await admission.release(held[0])
    newcomer = asyncio.create_task(client("newcomer"))  # arrives right when a slot frees
    await asyncio.sleep(0.05)
    assert order == ["a"] and admission.queue.waiting == 3  # b, c, then the newcomer
    await admission.release(held[1])
    await asyncio.sleep(0.05)
    assert order == ["a", "b"]
    done.set()
    await asyncio.wait_for(asyncio.gather(*waiters, newcomer), 2)
    assert order == ["a", "b", "c", "newcomer"]
    assert all(e.inflight == 0 for e in fifo_state.pools.pd) and admission.queue.waiting == 0


async def test_a_waiter_that_cannot_use_the_free_pd_keeps_its_place(fifo_state):
    """A retry excludes the PD it failed on: the slot freed there goes to the next waiter,
    and the retry is served first when its own kind of slot frees."""
    admission = PdAdmission(fifo_state, RouterMetrics(lambda: fifo_state.pools))
    pd0, pd1 = fifo_state.pools.pd
    for e in (pd0, pd1):
        e.inflight = 1
    retry = asyncio.create_task(admission.acquire({"epd-pd-0"}, None))
    await asyncio.sleep(0.01)
    plain = asyncio.create_task(admission.acquire(set(), None))
    await asyncio.sleep(0.01)
    await admission.release(pd0)
    assert await asyncio.wait_for(plain, 1) is pd0 and not retry.done()
    await admission.release(pd1)
    assert await asyncio.wait_for(retry, 1) is pd1


async def test_many_clients_two_slots_nobody_starves(config):
    """The issue's case: 30 clients, 2 slots. First come first served: every request is
    served in arrival order, none times out while later ones go ahead."""
    cfg = parse_config(config(placement={"pd_max_inflight": 1, "queue_size": 64, "queue_timeout_s": 3}))
    state = RouterState(cfg, build_pools(cfg)[0])
    for e in state.pools.all():
        e.healthy = True
    admission = PdAdmission(state, RouterMetrics(lambda: state.pools))
    served: list[int] = []

    async def client(i: int) -> None:
        engine = await admission.acquire(set(), None)
        served.append(i)
        await asyncio.sleep(0.005)
        await admission.release(engine)

    tasks = []
    for i in range(30):
        tasks.append(asyncio.create_task(client(i)))
        await asyncio.sleep(0.001)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)  # every one served: no 429
    # served in arrival order, give or take the 2 slots (a task resumes a moment after its
    # slot is granted, and a newcomer may take a slot that is free while nobody waits)
    assert sorted(served) == list(range(30))
    assert all(abs(position - i) <= 2 for position, i in enumerate(served)), served


async def test_a_waiter_that_gives_up_leaves_the_queue(state, admission):
    for e in state.pools.pd:
        e.inflight = 1
    waiter = asyncio.create_task(admission.acquire(set(), None))
    await asyncio.sleep(0.02)
    assert admission.queue.waiting == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert admission.queue.waiting == 0
    assert [e.inflight for e in state.pools.pd] == [1, 1]
