"""The router's image path (epd_kit.preprocess.Preprocessor.render) as a plain callable.

The bench feeds it the same data URL the client would send, inside a one-image chat
message, and takes the item's wire strings from the rendered prompt: everything the router
does for an image (base64, hash, cache, decode, resize, pixel_values, serialization) is
included, plus a short chat template + tokenization that the plain path does not do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from epd_kit.preprocess.model_files import CheckpointFiles
from epd_kit.preprocess.preprocessor import Preprocessor
from epd_kit.preprocess.settings import Limits, Media


@dataclass(frozen=True)
class Wire:
    """What a request carries for one image."""

    ve_kwargs: str
    pd_kwargs: str
    grid_thw: tuple[int, int, int]


def router_image_path(
    checkpoint: Path, max_image_patches: int, workers: int = 1, engine_dtype: str = "auto"
) -> Callable[[str], Wire]:
    """`engine_dtype`: router.yaml `dtype` (the engines' --dtype), which sets the pixel dtype."""
    pre = Preprocessor(
        CheckpointFiles.load(checkpoint, engine_dtype=engine_dtype),
        model_id=str(checkpoint),
        limits=Limits(max_image_patches=max_image_patches),
        media=Media(),
        workers=workers,
    )
    loop = asyncio.new_event_loop()

    def prepare(url: str) -> Wire:
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "Describe the image."},
                ],
            }
        ]
        rendered = loop.run_until_complete(pre.render(messages))
        item = rendered.items[0]
        t, h, w = item.grid_thw
        return Wire(item.ve_kwargs_b64, item.pd_kwargs_b64, (int(t), int(h), int(w)))

    prepare.preprocessor = pre  # type: ignore[attr-defined]
    return prepare
