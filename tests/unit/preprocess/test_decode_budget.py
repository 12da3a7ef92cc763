"""A JPEG's scans are counted before decoding, a large image decodes in a
child process that is killed past `limits.image_decode_timeout_s` or when nobody waits for
it, and a client's image slot is held until its work has actually ended."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import pytest
from PIL import Image

from epd_kit.preprocess import ImageDecodeTooSlow, ImageDimensionsRejected, Limits
from epd_kit.preprocess.decoding import ImageDecoder
from epd_kit.preprocess.image import decode_image, jpeg_scans
from epd_kit.testing.images import data_url, image_part, make_image, png_data_url, user_message


def scan_bomb(side: int, extra_scans: int) -> bytes:
    """A progressive JPEG whose last scan is repeated `extra_scans` times (each
    copy of a 99-byte scan cost an 8192x8192 decode ~50 ms more)."""
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 80, 40)).save(buf, format="JPEG", progressive=True, quality=70)
    data = buf.getvalue()
    last = data.rindex(b"\xff\xda")
    return data[:-2] + data[last:-2] * extra_scans + b"\xff\xd9"


def jpeg(side: int, **save: object) -> bytes:
    buf = io.BytesIO()
    make_image(side, side).save(buf, format="JPEG", **save)
    return buf.getvalue()


def test_jpeg_scans_are_counted_from_the_markers():
    assert jpeg_scans(jpeg(64), 100) == 1
    progressive = jpeg(64, progressive=True)
    assert jpeg_scans(progressive, 100) == 10  # libjpeg's standard progression
    assert jpeg_scans(scan_bomb(64, 25), 1000) == 35
    assert jpeg_scans(scan_bomb(64, 25), 12) == 12  # stops counting at stop_at
    # nothing after EOI counts (a decoder stops there too), nor does a truncated segment
    assert jpeg_scans(progressive + progressive[2:], 100) == 10
    assert jpeg_scans(progressive[:40], 100) == 0


def test_a_jpeg_over_the_scan_limit_is_refused_before_decoding(monkeypatch):
    bomb = scan_bomb(256, 60)
    loads = []
    real_decoder = Image._getdecoder
    monkeypatch.setattr(Image, "_getdecoder", lambda *a, **k: loads.append(1) or real_decoder(*a, **k))
    with pytest.raises(ImageDimensionsRejected, match=r"more than 64 scans \(limits.max_jpeg_scans\)"):
        decode_image(bomb, Limits())
    assert loads == []
    assert decode_image(bomb, Limits(max_jpeg_scans=70)).size == (256, 256)


async def test_an_image_decoded_in_a_child_process_is_the_same_as_in_the_thread(make_preprocessor):
    url = data_url(jpeg(300, progressive=True), "image/jpeg")
    inline = await make_preprocessor().render([user_message(image_part(url))])
    child = make_preprocessor(limits=Limits(image_decode_inline_pixels=0))
    isolated = await child.render([user_message(image_part(url))])
    assert isolated.items[0].ve_kwargs == inline.items[0].ve_kwargs
    assert isolated.token_ids == inline.token_ids
    assert child._decoder._idle  # the child stays for the next image


def test_a_decode_past_its_budget_is_stopped_and_the_next_image_decodes(checkpoint):
    from epd_kit.preprocess.model_files import CheckpointFiles

    vision = CheckpointFiles.load(checkpoint).vision
    limits = Limits(image_decode_inline_pixels=0, image_decode_timeout_s=0.3, max_jpeg_scans=2000)
    decoder = ImageDecoder(limits, vision)
    try:
        decoder.decode(jpeg(32), None)  # a warm child: the budget then measures the decode alone
        bomb = scan_bomb(2048, 1500)  # seconds of decode on one core
        t = time.monotonic()
        with pytest.raises(ImageDecodeTooSlow, match=r"within 0.3s \(limits.image_decode_timeout_s\)"):
            decoder.decode(bomb, None)
        assert time.monotonic() - t < 2.0
        assert decoder.killed == 1
        assert decoder.decode(jpeg(64), None).source_size == (64, 64)  # a fresh child
    finally:
        decoder.close()


async def test_a_client_slot_is_held_until_its_image_work_has_ended(make_preprocessor, monkeypatch):
    """A client that left had its slot freed while its decode kept running,
    so it could start another. The slot now goes only when the thread is done."""
    pre = make_preprocessor(limits=Limits(image_workers=2), workers=None)
    release = threading.Event()
    started = threading.Event()

    def blocked_prepare(mm_hash, data, cancelled=None):
        started.set()
        release.wait(10)  # an uninterruptible decode: it ignores `cancelled`
        raise RuntimeError("stopped")

    monkeypatch.setattr(pre, "_prepare", blocked_prepare)
    render = asyncio.create_task(pre.render([user_message(image_part(png_data_url(32, 32)))]))
    try:
        await asyncio.to_thread(started.wait, 5)
        render.cancel()
        await asyncio.gather(render, return_exceptions=True)
        await asyncio.sleep(0.1)
        assert pre._client_slots.holders() == 1  # the thread still works: the slot is held
    finally:
        release.set()
    for _ in range(100):
        if pre._client_slots.holders() == 0:
            break
        await asyncio.sleep(0.02)
    assert pre._client_slots.holders() == 0


async def test_a_cancelled_decode_in_a_child_stops_at_once(make_preprocessor):
    limits = Limits(image_decode_inline_pixels=0, max_jpeg_scans=2000, image_decode_timeout_s=60)
    pre = make_preprocessor(limits=limits)
    await pre.render([user_message(image_part(png_data_url(32, 32)))])  # a warm child
    url = data_url(scan_bomb(2048, 1500), "image/jpeg")
    render = asyncio.create_task(pre.render([user_message(image_part(url))]))
    await asyncio.sleep(0.5)
    t = time.monotonic()
    render.cancel()
    await asyncio.gather(render, return_exceptions=True)
    for _ in range(100):
        if pre._client_slots.holders() == 0:
            break
        await asyncio.sleep(0.02)
    assert pre._client_slots.holders() == 0 and time.monotonic() - t < 1.0
    assert pre._decoder.killed == 1


def test_a_client_is_one_identity_however_it_sends_its_key_or_connects():
    from epd_kit.preprocess.fairness import client_identity

    assert client_identity("Bearer K", True, "127.0.0.1") == client_identity("bearer  K ", True, "127.0.0.2")
    assert client_identity("Bearer K", True, None) != client_identity("Bearer L", True, None)
    # without keys: the address, whatever the header says (an unchecked header is no identity)
    assert client_identity("Bearer K", False, "127.0.0.1") == client_identity(None, False, "127.0.0.1")
    assert client_identity(None, False, "127.0.0.1") != client_identity(None, False, "127.0.0.2")
