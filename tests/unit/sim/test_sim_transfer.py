"""VE encoder + side channel + PD loader in one process, over real 127.0.0.1 sockets."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import numpy as np
import pytest
from sim_args import config, pd_args, ve_args

from epd_kit import mm_serde
from epd_kit.sim.client import fake_image, ve_body
from epd_kit.sim.ec_loader import BlockLenMismatch, EcLoader
from epd_kit.sim.errors import ECLoadFailure, RequestRejected
from epd_kit.sim.faults import Faults
from epd_kit.sim.metrics import SimMetrics
from epd_kit.sim.model import embedding_bytes
from epd_kit.sim.profile import PROFILES
from epd_kit.sim.release import answer_shape
from epd_kit.sim.ve import VisionEncoderEngine, spread_over_replicas
from epd_kit.wire import EcLocator, GenerateRequest

ZERO = PROFILES["zero"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _ve(tiny_ckpt, faults: Faults | None = None) -> VisionEncoderEngine:
    args = ve_args(str(tiny_ckpt))
    extra = {"side_channel_host": "127.0.0.1", "side_channel_port": 0}
    args = dataclasses.replace(args, ec_transfer_config={**args.ec_transfer_config, "ec_connector_extra_config": extra})
    ve = VisionEncoderEngine(config(args, "8-11"), ZERO, SimMetrics("m", "ve"), faults or Faults(), answer_shape())
    await ve.start()
    return ve


def _loader(tiny_ckpt, timeout: float = 0.3, **vision) -> EcLoader:
    ac = {
        "mm_language_model_only": True,
        "vision_neuron_config": {"vision_attention_block_size": 1024, **vision},
    }
    args = dataclasses.replace(
        pd_args(str(tiny_ckpt)),
        additional_config=ac,
        ec_transfer_config={"ec_role": "ec_consumer", "ec_connector_extra_config": {"transfer_timeout_sec": timeout}},
    )
    return EcLoader(config(args, "0-7"), ZERO)


async def _encode(ve: VisionEncoderEngine, images) -> dict[str, EcLocator]:
    resp = await ve.generate(GenerateRequest.model_validate(ve_body(images)))
    return resp.ec_locators()


async def test_read_returns_verified_embeddings(tiny_ckpt) -> None:
    ve = await _ve(tiny_ckpt)
    try:
        a, b = fake_image((1, 4, 4), 1), fake_image((1, 8, 4), 2)
        locs = await _encode(ve, [a, b])
        got = await _loader(tiny_ckpt).load(locs)
        assert got == {a.mm_hash: embedding_bytes(a.mm_hash), b.mm_hash: embedding_bytes(b.mm_hash)}
        assert ve.side_channel.reads_served == 2
    finally:
        await ve.stop()


async def test_the_embedding_of_an_image_does_not_depend_on_its_wire_dtype(tiny_ckpt) -> None:
    """float32, bfloat16 (vLLM under --dtype bfloat16) and float16 items of one image: the VE
    takes each, and the embedding it writes is the image's (the sim embeds by mm_hash)."""
    image = fake_image((1, 4, 4), 5)
    pixels = mm_serde.decode_item_b64(image.full_b64)["pixel_values"].data
    for wire_pixels in (pixels, mm_serde.to_bfloat16(pixels), pixels.astype(np.float16)):
        item = mm_serde.encode_item_b64(mm_serde.qwen_vl_item(wire_pixels, image.grid))
        ve = await _ve(tiny_ckpt)
        try:
            locs = await _encode(ve, [dataclasses.replace(image, full_b64=item)])
            assert await _loader(tiny_ckpt).load(locs) == {image.mm_hash: embedding_bytes(image.mm_hash)}
        finally:
            await ve.stop()


@pytest.mark.parametrize("mode", ["slow", "hang", "refuse"])
async def test_side_channel_faults_become_ec_load_failure(tiny_ckpt, mode) -> None:
    ve = await _ve(tiny_ckpt, Faults(side_channel=mode, side_channel_delay_ms=1000))
    try:
        a = fake_image((1, 4, 4), 3)
        locs = await _encode(ve, [a])
        with pytest.raises(ECLoadFailure) as err:
            await asyncio.wait_for(_loader(tiny_ckpt, timeout=0.3).load(locs), 3)
        assert err.value.mm_hashes == [a.mm_hash]
        if mode == "refuse":
            assert "READ rejected" in err.value.cause
        else:
            assert "timed out after 0.30 s" in err.value.cause
    finally:
        await ve.stop()


async def test_unreachable_side_channel_is_a_handshake_failure(tiny_ckpt) -> None:
    loc = EcLocator(engine_id="epd-ve-9", host="127.0.0.1", port=_free_port(), remote_block_ids=[0], num_tokens=4)
    with pytest.raises(ECLoadFailure, match="Encoder-cache load failed") as err:
        await _loader(tiny_ckpt).load({"h": loc})
    assert "EC handshake with epd-ve-9" in err.value.cause


async def test_block_len_mismatch(tiny_ckpt) -> None:
    ve = await _ve(tiny_ckpt)
    try:
        locs = await _encode(ve, [fake_image((1, 4, 4), 4)])
        with pytest.raises(BlockLenMismatch, match="EC region block_len mismatch"):
            await _loader(tiny_ckpt, vision_attention_block_size=2048).load(locs)
    finally:
        await ve.stop()


async def test_ve_rejects_oversized_but_not_more_images_than_the_limit(tiny_ckpt) -> None:
    ve = await _ve(tiny_ckpt)
    try:
        with pytest.raises(RequestRejected, match="exceed vision_attention_block_size=1024"):
            await _encode(ve, [fake_image((1, 34, 32), 5)])
        # 31 images past --limit-mm-per-prompt's 30: a real VE serves them (vLLM checks the
        # limit in its multimodal processor, which the generate route skips; docs/sim.md)
        many = [fake_image((1, 2, 2), 100 + i) for i in range(31)]
        assert len(await _encode(ve, many)) == 31
    finally:
        await ve.stop()


def test_items_are_spread_over_dp_replicas() -> None:
    assert spread_over_replicas([1024, 1024, 512, 512], 4) == [1024, 1024, 512, 512]
    assert spread_over_replicas([1024, 512, 512], 2) == [1024, 1024]
    assert spread_over_replicas([], 4) == [0, 0, 0, 0]


async def test_ve_encodes_one_request_at_a_time_and_hits_skip_the_encode(tiny_ckpt) -> None:
    ve = await _ve(tiny_ckpt)
    ve.profile = dataclasses.replace(ZERO, encode_ms_per_1k_patches=1600.0)  # 16 patches = 25 ms
    try:
        a, b = fake_image((1, 4, 4), 7), fake_image((1, 4, 4), 8)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        waiting_seen = []

        async def watch() -> None:
            while True:
                waiting_seen.append(ve._waiting)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(_encode(ve, [a]), _encode(ve, [b]))
        watcher.cancel()
        assert loop.time() - t0 >= 0.045  # serialized: 2 x 25 ms
        assert max(waiting_seen) == 1
        t1 = loop.time()
        await _encode(ve, [a, b])  # both resident: no encode time at all
        assert loop.time() - t1 < 0.02
    finally:
        await ve.stop()


async def test_duplicate_engine_id_reads_the_wrong_ve_and_is_detected(tiny_ckpt) -> None:
    """Two VEs sharing an engine_id: the PD's cached handshake sends every READ to the first."""
    ve1, ve2 = await _ve(tiny_ckpt), await _ve(tiny_ckpt)
    try:
        a, b = fake_image((1, 4, 4), 9), fake_image((1, 4, 4), 10)
        loc_a, loc_b = await _encode(ve1, [a]), await _encode(ve2, [b])
        assert loc_a[a.mm_hash].engine_id == loc_b[b.mm_hash].engine_id
        assert loc_a[a.mm_hash].port != loc_b[b.mm_hash].port
        loader = _loader(tiny_ckpt)
        await loader.load(loc_a)
        with pytest.raises(ECLoadFailure) as err:
            await loader.load(loc_b)
        assert "does not hold" in err.value.cause
        assert ve2.side_channel.reads_served == 0
    finally:
        await ve1.stop()
        await ve2.stop()
