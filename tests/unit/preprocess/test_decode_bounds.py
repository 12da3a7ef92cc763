"""Decode cost is bounded before any pixel is decoded (bytes, pixels, frames), and text and
images run in separate pools so images in progress cannot delay a text-only request."""

from __future__ import annotations

import asyncio
import io
import threading

import pytest
from PIL import Image

from epd_kit.preprocess import ImageDimensionsRejected, Limits
from epd_kit.preprocess.image import decode_image
from epd_kit.testing.images import data_url, image_part, make_image, png_data_url, user_message


def gif(frames: int) -> bytes:
    images = [make_image(16, 16, seed=i).convert("P") for i in range(frames)]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=10)
    return buf.getvalue()


def test_an_animation_over_the_frame_limit_is_refused_before_decoding():
    decoded = decode_image(gif(5), Limits(max_image_frames=5))
    assert decoded.size == (16, 16) and decoded.mode == "RGB"  # the first frame
    with pytest.raises(ImageDimensionsRejected, match=r"more than 4 frames \(limits.max_image_frames\)"):
        decode_image(gif(5), Limits(max_image_frames=4))
    assert decode_image(gif(1), Limits(max_image_frames=1)).size == (16, 16)


def test_first_frame_is_what_is_used():
    frames = gif(3)
    with Image.open(io.BytesIO(frames)) as reference:
        first = reference.convert("RGB").tobytes()
    assert decode_image(frames, Limits(max_image_frames=3)).tobytes() == first


async def test_frame_limit_reaches_the_request_as_a_400(make_preprocessor):
    pre = make_preprocessor(limits=Limits(max_image_frames=2))
    with pytest.raises(ImageDimensionsRejected) as err:
        await pre.render([user_message(image_part(data_url(gif(3), "image/gif")))])
    assert err.value.status == 400 and err.value.param == "messages[0].content[0]"


async def test_images_in_progress_do_not_delay_a_text_only_request(make_preprocessor, monkeypatch):
    """Every image thread busy (here: blocked) and a text request still renders at once."""
    pre = make_preprocessor(limits=Limits(text_workers=1, image_workers=1), workers=None)
    release = threading.Event()
    real_prepare = pre._prepare

    def blocked_prepare(*args):
        release.wait(10)
        return real_prepare(*args)

    monkeypatch.setattr(pre, "_prepare", blocked_prepare)
    images = [
        asyncio.create_task(pre.render([user_message(image_part(png_data_url(64, 64, seed=s)))])) for s in range(4)
    ]
    try:
        await asyncio.sleep(0.05)
        text = await asyncio.wait_for(pre.render([user_message("only text")]), 2)
        assert text.token_ids and not text.items
        assert not any(t.done() for t in images)
    finally:
        release.set()
    assert all(len(r.items) == 1 for r in await asyncio.gather(*images))


# --- image work bounded in time, per client, and by format ------------------------


def _big_gif(frames: int, side: int) -> bytes:
    """`frames` copies of one `side`x`side` frame: small on the wire, costly to decode (the
    shape of the attack: 999 frames of 4096x4096 in 14 MB)."""
    one = _gif_of(side)
    start = one.index(b"\x21\xf9")  # the frame: graphic control extension + image block
    return one[:start] + one[start:-1] * frames + b"\x3b"


def _gif_of(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("P", (side, side), 0).save(buf, format="GIF", duration=10)
    data = buf.getvalue()
    if b"\x21\xf9" not in data:  # Pillow left out the control block: add a neutral one
        at = data.index(b"\x2c", 13)
        data = data[:at] + b"\x21\xf9\x04\x00\x0a\x00\x00\x00" + data[at:]
    return data


def test_gif_frames_are_counted_without_decoding_any(monkeypatch):
    """Pillow's frame walk decodes every frame it passes. The count now
    reads the block structure: refused or not, at most the first frame is decoded."""
    from epd_kit.preprocess.image import gif_frames

    data = _big_gif(50, 256)
    assert gif_frames(data, 1000) == 50 and gif_frames(data, 10) == 10
    assert gif_frames(gif(7), 1000) == 7
    loads = []  # decoders made: one per frame decoded
    real_decoder = Image._getdecoder
    monkeypatch.setattr(Image, "_getdecoder", lambda *a, **k: loads.append(1) or real_decoder(*a, **k))
    with pytest.raises(ImageDimensionsRejected, match="more than 49 frames"):
        decode_image(data, Limits(max_image_frames=49))
    assert loads == []  # refused with nothing decoded
    assert decode_image(data, Limits(max_image_frames=50)).size == (256, 256)
    assert len(loads) == 1  # the first frame only


def test_formats_off_the_allow_list_never_reach_a_decoder(monkeypatch):
    """Pillow's EPS plugin (Ghostscript) was reachable from client bytes."""
    from PIL import EpsImagePlugin

    from epd_kit.preprocess import NotAnImage

    opened = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda self: opened.append(1))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nshowpage\n"
    with pytest.raises(NotAnImage, match=r"PNG, JPEG, WEBP, GIF, BMP; limits.image_formats"):
        decode_image(eps, Limits())
    assert opened == []
    png = io.BytesIO()
    make_image(8, 8).save(png, format="PNG")
    with pytest.raises(NotAnImage):
        decode_image(png.getvalue(), Limits(image_formats=["JPEG"]))
    with pytest.raises(ValueError, match="image_formats"):
        Limits(image_formats=["EPS"])


async def test_image_work_nobody_waits_for_is_cancelled(make_preprocessor, monkeypatch):
    """Two requests got 504 and their image threads went on for minutes.
    When every request waiting for an image has ended, a queued job never starts and a running
    one is told to stop."""
    pre = make_preprocessor(limits=Limits(image_workers=1), workers=None)
    release = threading.Event()
    started: list[threading.Event | None] = []

    def blocked_prepare(mm_hash, data, cancelled=None):
        started.append(cancelled)
        release.wait(10)
        raise RuntimeError("stopped")

    monkeypatch.setattr(pre, "_prepare", blocked_prepare)
    renders = [
        asyncio.create_task(pre.render([user_message(image_part(png_data_url(32, 32, seed=s)))])) for s in range(3)
    ]
    try:
        for _ in range(100):
            await asyncio.sleep(0.01)
            if started:
                break
        for task in renders:
            task.cancel()
        await asyncio.gather(*renders, return_exceptions=True)
        assert len(started) == 1 and started[0] is not None and started[0].is_set()
    finally:
        release.set()
    await asyncio.sleep(0.1)
    assert len(started) == 1  # the queued images never started


async def test_one_client_cannot_hold_every_image_worker(make_preprocessor, monkeypatch):
    """Unrelated small images waited 37-90 s behind one client's GIFs.
    With 2 image threads one client holds at most 1 (limits.image_jobs_per_client)."""
    from epd_kit.preprocess.fairness import current_client

    pre = make_preprocessor(limits=Limits(image_workers=2), workers=None)
    release = threading.Event()
    real_prepare = pre._prepare

    def slow_for_a(mm_hash, data, cancelled=None):
        if current_client_in_thread.get(mm_hash) == "a":
            release.wait(10)
        return real_prepare(mm_hash, data, cancelled)

    current_client_in_thread: dict[str, str] = {}
    monkeypatch.setattr(pre, "_prepare", slow_for_a)

    async def render_as(client: str, seed: int):
        current_client.set(client)
        url = png_data_url(32, 32, seed=seed)
        from epd_kit.preprocess.hashing import image_hash
        from epd_kit.preprocess.media import decode_data_url

        current_client_in_thread[image_hash(pre.model_id, decode_data_url(url, pre.limits), pre._settings_blob)] = (
            client
        )
        return await pre.render([user_message(image_part(url))])

    attack = [asyncio.create_task(render_as("a", s)) for s in range(4)]
    try:
        await asyncio.sleep(0.05)
        other = await asyncio.wait_for(render_as("b", 99), 5)
        assert len(other.items) == 1 and not any(t.done() for t in attack)
    finally:
        release.set()
    assert all(len(r.items) == 1 for r in await asyncio.gather(*attack))
