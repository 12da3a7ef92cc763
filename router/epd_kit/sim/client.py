"""Hand-built VE/PD requests without the router: for contract tests, benchmarks and demos.

`FakeImage` stands in for one preprocessed image (Qwen3-VL layout: pixel_values
[t*h*w, patch_dim] + image_grid_thw); `ve_body`/`pd_body` assemble the wire bodies of
docs/contract.md §2.2 and §3.1 exactly as a router would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from blake3 import blake3

from .. import mm_serde
from ..preprocess.model_files import VisionGeometry, vision_geometry
from ..wire import (
    EC_LOCATOR,
    EcHandoffItem,
    EcLocator,
    EcTransferItem,
    Features,
    GenerateRequest,
    HandoffKind,
    Placeholder,
    SamplingParams,
    encode_request,
    handoff_request_fields,
)


@dataclass(frozen=True)
class FakeImage:
    mm_hash: str
    grid: tuple[int, int, int]
    full_b64: str  # what the VE gets
    lm_b64: str  # what the PD gets (image_grid_thw only)
    num_tokens: int


def fake_image(grid: tuple[int, int, int], seed: int = 0, geometry: VisionGeometry | None = None) -> FakeImage:
    geo = geometry or vision_geometry({})
    t, h, w = grid
    rng = np.random.default_rng(seed)
    pixels = rng.standard_normal((t * h * w, geo.patch_dim), dtype=np.float32)
    item = mm_serde.qwen_vl_item(pixels, grid)
    mm_hash = blake3(pixels.tobytes() + np.asarray(grid, "<i8").tobytes()).hexdigest()
    return FakeImage(
        mm_hash=mm_hash,
        grid=grid,
        full_b64=mm_serde.encode_item_b64(item),
        lm_b64=mm_serde.encode_item_b64(mm_serde.lm_only(item)),
        num_tokens=t * h * w // geo.merge_factor,
    )


def ve_body(images: Sequence[FakeImage], request_id: str = "req/enc/ve-0") -> dict[str, Any]:
    """Contract §2.2: unique items, contiguous placeholders over synthetic zero tokens."""
    unique = {im.mm_hash: im for im in images}.values()
    return encode_request(request_id, [(im.mm_hash, im.num_tokens, im.full_b64) for im in unique]).wire_dict()


def build_prompt(
    images: Sequence[FakeImage], image_token_id: int, text_ids: Sequence[int] = (11, 12, 13)
) -> tuple[list[int], list[Placeholder]]:
    """text, then each image's pad run separated by a text token, then text again."""
    ids: list[int] = list(text_ids)
    placeholders = []
    for im in images:
        ids.append(text_ids[0])
        placeholders.append(Placeholder(offset=len(ids), length=im.num_tokens))
        ids.extend([image_token_id] * im.num_tokens)
        ids.append(text_ids[-1])
    ids.extend(text_ids)
    return ids, placeholders


def pd_body(
    prompt_ids: Sequence[int],
    images: Sequence[FakeImage],
    placeholders: Sequence[Placeholder],
    locators: dict[str, EcHandoffItem | dict[str, Any]],
    *,
    max_tokens: int | None = 16,
    stream: bool = False,
    include_usage: bool | None = None,
    request_id: str = "req",
    ignore_eos: bool | None = None,
    handoff: HandoffKind = EC_LOCATOR,
) -> dict[str, Any]:
    """Contract §3.1: real prompt, per-item placeholders (duplicates kept), LM-only kwargs, the
    items' hand-off (`locators`, by mm_hash) where `handoff` puts it."""
    model = EcLocator if handoff == EC_LOCATOR else EcTransferItem
    locs = {h: model.model_validate(loc) if isinstance(loc, dict) else loc for h, loc in locators.items()}
    extra, top = handoff_request_fields(handoff, None, locs)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, extra_args=extra)
    req = GenerateRequest(
        **top,
        request_id=request_id,
        token_ids=list(prompt_ids),
        features=Features.of_images([im.mm_hash for im in images], list(placeholders), [im.lm_b64 for im in images]),
        sampling_params=sp,
        stream=stream,
        stream_options=None if include_usage is None else {"include_usage": include_usage},
    )
    return req.wire_dict()
