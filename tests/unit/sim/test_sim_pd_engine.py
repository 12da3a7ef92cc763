"""The PD engine loop in process: slots, queueing, aborts, fatal load errors."""

from __future__ import annotations

import asyncio
import dataclasses

from sim_args import config, pd_args

from epd_kit.sim.errors import ECLoadFailure
from epd_kit.sim.metrics import SimMetrics
from epd_kit.sim.pd import PrefillDecodeEngine, Sequence
from epd_kit.sim.profile import PROFILES
from epd_kit.wire import Placeholder


def _engine(tiny_ckpt, max_num_seqs: int, decode_ms: float = 5.0):
    cfg = config(pd_args(str(tiny_ckpt), max_num_seqs=max_num_seqs), "0-7")
    profile = dataclasses.replace(PROFILES["zero"], decode_ms_per_token=decode_ms)
    deaths: list[BaseException] = []
    eng = PrefillDecodeEngine(cfg, profile, SimMetrics("m", "pd"), deaths.append)
    return eng, deaths


def _seq(i: int, max_tokens: int = 5, **kw) -> Sequence:
    fields = {"hashes": [], "placeholders": [], "locators": {}, **kw}
    return Sequence(request_id=f"r{i}", prompt_ids=[1, 2, 3, i], max_tokens=max_tokens, ignore_eos=True, **fields)


async def test_at_most_max_num_seqs_run_the_rest_wait(tiny_ckpt) -> None:
    eng, _ = _engine(tiny_ckpt, max_num_seqs=2)
    await eng.start()
    seqs = [_seq(i) for i in range(5)]
    for s in seqs:
        eng.submit(s)
    peak = 0
    while not all(s.done for s in seqs):
        peak = max(peak, len(eng.running))
        assert len(eng.running) <= 2
        await asyncio.sleep(0.001)
    assert peak == 2
    assert all(s.finish_reason == "length" and s.emitted == 5 for s in seqs)
    await eng.stop()


async def test_abort_frees_the_slot(tiny_ckpt) -> None:
    eng, _ = _engine(tiny_ckpt, max_num_seqs=1)
    await eng.start()
    long, short = _seq(1, max_tokens=10_000), _seq(2, max_tokens=3)
    eng.submit(long)
    eng.submit(short)
    await asyncio.sleep(0.03)
    assert short.state == "waiting"
    eng.abort(long)
    await asyncio.wait_for(short.wait_done(), 2)
    assert long.finish_reason == "abort" and short.finish_reason == "length"
    await eng.stop()


async def test_missing_locator_kills_the_engine(tiny_ckpt) -> None:
    eng, deaths = _engine(tiny_ckpt, max_num_seqs=4)
    await eng.start()
    bystander = _seq(1, max_tokens=10_000)
    eng.submit(bystander)
    bad = _seq(2, hashes=["h1"], placeholders=[Placeholder(offset=0, length=1)])
    eng.submit(bad)
    await asyncio.wait_for(bad.wait_done(), 2)
    assert isinstance(bad.error, ECLoadFailure)
    assert str(bad.error) == "Encoder-cache load failed for mm_hashes: ['h1']"
    assert bystander.finish_reason == "error"  # the whole engine core is gone
    assert len(deaths) == 1 and eng.dead is not None
    await eng.stop()
