"""The per-item content hash (mm_hash): one scheme, documented in docs/preprocessing.md.

    mm_hash = blake3( b"model_id"  + UTF8(model_id)
                    + b"image"     + original encoded image bytes
                    + b"processor" + UTF8(canonical JSON of the pixel settings) ).hexdigest()

It uses vLLM's framing (each leaf as its key, then its value bytes) and the encoded bytes,
as newer vLLM does for images it has the bytes of. Pixel settings = the checkpoint's
resize/normalize settings plus our patch budget (which can change pixel_values by
downscaling); canonical JSON = sorted keys, no spaces, ASCII. The same image sent again,
by the same router config, for the same model id, gets the same hash: that is what keeps
repeated images on the same VE (HRW) and lets our preprocessing cache skip all work.
"""

from __future__ import annotations

import json
from typing import Any

from blake3 import blake3

SCHEME = "epd-kit/mm-hash/1"


def settings_bytes(settings: dict[str, Any]) -> bytes:
    return json.dumps({"scheme": SCHEME, **settings}, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode(
        "ascii"
    )


def image_hash(model_id: str, encoded: bytes, settings_blob: bytes) -> str:
    hasher = blake3()
    hasher.update(b"model_id")
    hasher.update(model_id.encode("utf-8"))
    hasher.update(b"image")
    hasher.update(encoded)
    hasher.update(b"processor")
    hasher.update(settings_blob)
    return hasher.hexdigest()
