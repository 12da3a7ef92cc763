"""Deterministic test JPEGs that compress like photographs, not like noise.

Each image is a random 8x8 colour field upscaled smoothly (large soft shapes) plus mild
grain, so a 512x512 JPEG at quality 90 is tens of kB like a photo, not the ~230 kB of pure
noise: decode cost then resembles real traffic. Image `i` of a size is always the same bytes.
"""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def jpeg(index: int, width: int = 512, height: int = 512, quality: int = 90) -> bytes:
    rng = np.random.default_rng([width, height, index])
    coarse = Image.fromarray(rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8), "RGB")
    smooth = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.integers(-8, 9, size=smooth.shape, dtype=np.int16)
    arr = np.clip(smooth + grain, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode("ascii")


def jpeg_variant(jpeg: bytes, n: int) -> bytes:
    """Same pixels, different bytes (so a different content hash): a COM segment right after
    SOI carries `n`."""
    comment = f"bench-{n}".encode()
    segment = b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment
    return jpeg[:2] + segment + jpeg[2:]
