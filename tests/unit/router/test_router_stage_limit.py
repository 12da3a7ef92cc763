"""A stage's time limit (context.StageLimit): the request's deadline over one stage, a 504
naming the stage when it passes, and nothing else changed: the task's cancel count is as
before, a cancel from elsewhere stays a cancel, a TimeoutError of the stage's own passes."""

from __future__ import annotations

import asyncio
import time

import pytest

from epd_kit.router.context import RequestContext
from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import parse_request


def context(total_s: float) -> RequestContext:
    request = parse_request({"messages": [{"role": "user", "content": "hi"}]})
    return RequestContext(request_id="r", request=request, model="m", total_timeout_s=total_s)


async def test_the_deadline_passing_in_a_stage_is_a_504_naming_it():
    ctx = context(0.2)
    started = time.monotonic()
    with pytest.raises(RouterError) as raised:
        async with ctx.time_limit("generate"):
            await asyncio.sleep(10)
    assert raised.value.status == 504 and "during generate" in raised.value.message
    assert 0.15 <= time.monotonic() - started < 5
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # its own cancel was taken back
    await asyncio.sleep(0)  # and the task goes on


async def test_a_deadline_already_past_fires_at_the_stages_first_wait():
    ctx = context(0.0)
    with pytest.raises(RouterError, match="during preprocessing"):
        async with ctx.time_limit("preprocessing"):
            await asyncio.sleep(1)


async def test_a_stage_that_ends_in_time_leaves_nothing_behind():
    ctx = context(0.3)
    async with ctx.time_limit("preprocessing"):
        await asyncio.sleep(0)
    await asyncio.sleep(0.5)  # past the deadline: no cancel arrives later


async def test_a_cancel_from_elsewhere_stays_a_cancel():
    ctx = context(10.0)

    async def stage() -> None:
        async with ctx.time_limit("generate"):
            await asyncio.sleep(10)

    task = asyncio.ensure_future(stage())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_timeout_error_of_the_stage_itself_passes_unchanged():
    ctx = context(10.0)
    with pytest.raises(TimeoutError, match="the engine client's"):
        async with ctx.time_limit("generate"):
            raise TimeoutError("the engine client's")
