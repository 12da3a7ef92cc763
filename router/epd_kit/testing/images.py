"""Deterministic test images and the OpenAI message parts that carry them."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from PIL import Image


def make_image(width: int, height: int, *, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A reproducible image with structure (gradients) and noise, so resizing matters."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [
            (x * 255 // max(width - 1, 1)),
            (y * 255 // max(height - 1, 1)),
            ((x + y) * 127 // max(width + height - 2, 1)),
        ],
        axis=-1,
    )
    noise = rng.integers(0, 64, size=(height, width, 3))
    rgb = Image.fromarray(((base + noise) % 256).astype(np.uint8), "RGB")
    return rgb if mode == "RGB" else rgb.convert(mode)


def encode_image(image: Image.Image, fmt: str = "PNG", **save_args: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save_args)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def png_data_url(width: int, height: int, *, seed: int = 0) -> str:
    return data_url(encode_image(make_image(width, height, seed=seed)))


def user_message(*parts: str | dict[str, Any]) -> dict[str, Any]:
    """A user message from text strings and image parts, in order."""
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return {"role": "user", "content": content}
