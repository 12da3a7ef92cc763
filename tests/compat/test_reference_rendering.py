"""The router's rendering against vLLM's own (`/v1/chat/completions/render`, what the
reference disaggregated router sends), for the same chat request and the tutorial's engine
argv (`--dtype bfloat16`). The one known difference, the fast processor's resize, is pinned
as a bound."""

from __future__ import annotations

import base64
import io
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from epd_kit import mm_serde
from epd_kit.preprocess import CheckpointFiles, Limits
from epd_kit.preprocess.image import PixelEncoder, plan_resize
from epd_kit.testing.images import (
    data_url,
    encode_image,
    image_part,
    make_image,
    user_message,
)
from tests.compat.cases import CHATS, IMAGE_CHATS, PROMPT, field_layout, image_features
from tests.compat.stack import CompatStack, Exchange
from tests.compat.vllm_api import decode_mm_kwargs_item


@pytest.fixture(scope="module")
def rendered(stack: CompatStack) -> dict[str, tuple[dict[str, Any], Exchange]]:
    """chat -> (vLLM's GenerateRequest for it, the router's exchange for it)."""
    return {name: (stack.render(messages), stack.chat(messages)) for name, messages in CHATS.items()}


def _vllm_pixels(vllm_body: dict[str, Any]) -> torch.Tensor:
    ((_, _, _, kwargs_b64),) = image_features(vllm_body)
    return decode_mm_kwargs_item(kwargs_b64)["pixel_values"].data


def _router_pixels(ex: Exchange) -> np.ndarray:
    ((_, _, _, kwargs_b64),) = image_features(ex.ve_bodies[0])
    return mm_serde.decode_item_b64(kwargs_b64)["pixel_values"].data


def _image_of(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


@cache
def _processor(checkpoint: Path, backend: str) -> Any:
    return AutoImageProcessor.from_pretrained(str(checkpoint), backend=backend)


def _processed(checkpoint: Path, backend: str, image: Image.Image) -> torch.Tensor:
    return _processor(checkpoint, backend)(images=[image], return_tensors="pt")["pixel_values"]


def _one_image(chat: list[dict[str, Any]]) -> Image.Image:
    (part,) = [p for p in chat[0]["content"] if p["type"] == "image_url"]
    return _image_of(part["image_url"]["url"])


# --- what is the same ---


@pytest.mark.parametrize("chat", CHATS)
def test_prompt_tokens_and_placeholders_equal_vllms(chat: str, rendered) -> None:
    vllm_body, ex = rendered[chat]
    pd_body = ex.pd_bodies[0]
    assert pd_body["token_ids"] == vllm_body["token_ids"]
    ours = [(off, length) for _, off, length, _ in image_features(pd_body)]
    assert ours == [(off, length) for _, off, length, _ in image_features(vllm_body)]


@pytest.mark.parametrize("chat", IMAGE_CHATS)
def test_image_grids_equal_vllms(chat: str, rendered) -> None:
    vllm_body, ex = rendered[chat]
    vllm_grids = [decode_mm_kwargs_item(k)["image_grid_thw"].data.tolist() for *_, k in image_features(vllm_body)]
    ours = [list(mm_serde.grid_thw(mm_serde.decode_item_b64(k))) for *_, k in image_features(ex.pd_bodies[0])]
    assert ours == vllm_grids


def test_vllm_renders_pixels_with_the_fast_processor_in_the_model_dtype(rendered, checkpoint) -> None:
    """Pins the reference: vLLM asks transformers for the fast (torchvision) processor and casts its
    output to the engine's dtype (bfloat16 under the tutorial's argv). 0.32 does so with the plan's
    --no-mm-device-do-normalize (the stack's ENGINE_FLAGS); by default it would ask without rescaling
    and normalising (mm_device_do_normalize, on for Qwen3-VL: config/multimodal.py:352,
    models/qwen3_vl.py:1964) and send resized uint8 pixels, normalised on the device."""
    vllm_body, _ = rendered["one-image"]
    image = _one_image(CHATS["one-image"])
    fast = _processed(checkpoint, "torchvision", image)
    assert torch.equal(_vllm_pixels(vllm_body), fast.to(torch.bfloat16))


def test_router_pixels_equal_the_pil_processor_cast_to_the_model_dtype(rendered, checkpoint) -> None:
    _, ex = rendered["one-image"]
    pil = _processed(checkpoint, "pil", _one_image(CHATS["one-image"])).to(torch.bfloat16)
    ours = _router_pixels(ex)
    assert ours.dtype == mm_serde.BFLOAT16
    np.testing.assert_array_equal(ours.view(np.uint16), pil.view(torch.int16).numpy().view(np.uint16))


# --- what differs, within a bound; and what issue 12 made the same ---


def test_router_pixels_are_within_one_uint8_level_of_the_fast_processor(checkpoint) -> None:
    """The documented bound (docs/preprocessing.md "Pixel parity"), before either side's cast
    to the model dtype: the router computes like the PIL processor; against the fast one vLLM
    uses, the normalization's op order moves most values by a float32 rounding step, and
    torchvision's resize rounds a few pixels to the neighbouring uint8 level."""
    image = _one_image(CHATS["one-image"])
    vision = CheckpointFiles.load(checkpoint, engine_dtype="float32").vision
    pixels = PixelEncoder(vision)
    ours = pixels.pixel_values(pixels.resize(image, plan_resize(image.height, image.width, vision, Limits())))
    fast = _processed(checkpoint, "torchvision", image).numpy()
    assert type(_processor(checkpoint, "torchvision")).__name__ == "Qwen2VLImageProcessor"  # the fast one
    one_level = vision.rescale_factor / min(vision.image_std)
    diff = np.abs(ours - fast)
    resized_apart = diff > 1e-6
    assert 0 < np.mean(resized_apart) < 0.01  # 0.07 % for this image; none would be news
    assert diff.max() <= one_level * (1 + 1e-5)
    assert diff[~resized_apart].max() <= 6e-8  # op order: one float32 step at |x| <= 1


def test_ve_pixels_travel_in_the_engine_dtype(rendered) -> None:
    """vLLM's VE renders normalised pixels in the engine dtype, as the router sends them: on 0.32
    only with --no-mm-device-do-normalize (the plan's SERVE_FLAGS, which the stack runs), else it
    renders raw uint8 and normalises on the device (config/multimodal.py:352, qwen3_vl.py:1964)."""
    theirs, ve_item = (field_layout(k)["pixel_values"] for k in _items(rendered)[:2])
    assert ve_item[0] == theirs[0] == "bfloat16"


def _items(rendered, chat: str = "one-image") -> tuple[str, str, str]:
    """kwargs_b64 of (vLLM's item, the router's VE item, the router's PD item) for one image."""
    vllm_body, ex = rendered[chat]
    ((*_, theirs),) = image_features(vllm_body)
    ((*_, ve_item),) = image_features(ex.ve_bodies[0])
    ((*_, pd_item),) = image_features(ex.pd_bodies[0])
    return theirs, ve_item, pd_item


def test_grid_keep_on_cpu_equals_vllms(rendered) -> None:
    theirs, ve_item, pd_item = (field_layout(k)["image_grid_thw"] for k in _items(rendered))
    assert ve_item == pd_item == theirs


def test_pixel_values_field_equals_vllms(rendered) -> None:
    theirs, ve_item = (field_layout(k)["pixel_values"] for k in _items(rendered)[:2])
    assert ve_item[1:] == theirs[1:]


# --- EXIF orientation: a phone photo, 512x341 stored, Orientation=6 (rotate 90° clockwise) ---

UPRIGHT_GRID = [1, 32, 22]  # 341 wide x 512 high once rotated, in 16-pixel patches


def _exif_rotated_photo() -> list[dict[str, Any]]:
    image = make_image(512, 341, seed=4)
    exif = image.getexif()
    exif[0x0112] = 6  # Orientation
    url = data_url(encode_image(image, "JPEG", exif=exif.tobytes(), quality=95), "image/jpeg")
    return [user_message(image_part(url), PROMPT)]


def test_vllm_uprights_an_exif_rotated_photo(stack: CompatStack) -> None:
    ((*_, kwargs_b64),) = image_features(stack.render(_exif_rotated_photo()))
    assert decode_mm_kwargs_item(kwargs_b64)["image_grid_thw"].data.tolist() == UPRIGHT_GRID


def test_router_uprights_an_exif_rotated_photo(stack: CompatStack) -> None:
    ex = stack.chat(_exif_rotated_photo())
    ((*_, kwargs_b64),) = image_features(ex.ve_bodies[0])
    assert list(mm_serde.grid_thw(mm_serde.decode_item_b64(kwargs_b64))) == UPRIGHT_GRID
