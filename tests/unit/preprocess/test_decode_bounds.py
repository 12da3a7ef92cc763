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
