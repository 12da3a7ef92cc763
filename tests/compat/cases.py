"""The chat requests every comparison of the tier is made on, and small readers of wire bodies."""

from __future__ import annotations

import base64
from typing import Any

import msgpack

from epd_kit.testing.images import image_part, png_data_url, user_message

PROMPT = "Describe the picture."
A, B, C = (png_data_url(64, 64, seed=1), png_data_url(96, 48, seed=2), png_data_url(512, 341, seed=3))

CHATS: dict[str, list[dict[str, Any]]] = {
    "one-image": [user_message(image_part(C), PROMPT)],
    "several-images": [user_message(image_part(A), image_part(B), image_part(C), PROMPT)],
    "duplicate-images": [user_message(image_part(A), image_part(B), image_part(A), PROMPT)],
    "text-only": [user_message(PROMPT)],
}
IMAGE_CHATS = [name for name in CHATS if name != "text-only"]
IMAGES = {"one-image": (1, 1), "several-images": (3, 3), "duplicate-images": (3, 2), "text-only": (0, 0)}
"""chat -> (images in the prompt, distinct images)"""


def image_features(body: dict[str, Any]) -> list[tuple[str, int, int, str]]:
    """(mm_hash, offset, length, kwargs_b64) of a generate body's images, in body order."""
    features = body.get("features") or {}
    hashes = (features.get("mm_hashes") or {}).get("image", [])
    placeholders = (features.get("mm_placeholders") or {}).get("image", [])
    kwargs = (features.get("kwargs_data") or {}).get("image", [])
    return [(h, p["offset"], p["length"], k) for h, p, k in zip(hashes, placeholders, kwargs, strict=True)]


def field_layout(kwargs_b64: str) -> dict[str, tuple[str | None, str, dict[str, Any]]]:
    """field -> (tensor dtype, factory, factory arguments) of one mm_serde item, read with plain
    msgpack (no codec: this must read items either codec refuses)."""
    doc = msgpack.unpackb(base64.b64decode(kwargs_b64), raw=False, ext_hook=lambda code, data: bytes(data))
    return {
        key: (elem["data"][0] if elem["data"] else None, elem["field"][0], dict(elem["field"][1]))
        for key, elem in doc.items()
    }
