"""Resize rules, patch budget and pixel_values against transformers' own image processor.

The comparison is with transformers' PIL-backend Qwen2-VL processor, asked for by name: with
torchvision installed transformers would pick the fast (torchvision) one, whose resize
differs by one uint8 level in places (docs/preprocessing.md "Pixel parity"; tests/compat
pins that bound against vLLM's own output).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from epd_kit import mm_serde
from epd_kit.preprocess import CheckpointFiles, ImageDimensionsRejected, ImageOverBudget, Limits
from epd_kit.preprocess.image import PixelEncoder, decode_image, plan_resize, smart_resize
from epd_kit.testing.images import encode_image, make_image


@pytest.fixture(scope="module")
def vision(checkpoint: Path):
    """float32 pixels: what transformers' processor returns before vLLM casts them."""
    v = CheckpointFiles.load(checkpoint, engine_dtype="float32").vision
    assert v is not None
    return v


@pytest.fixture(scope="module")
def hf_processor(checkpoint: Path):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(checkpoint), local_files_only=True, backend="pil")


UNBOUNDED = Limits(max_image_patches=1 << 20)


def _ours(vision, image, limits: Limits = UNBOUNDED):
    enc = PixelEncoder(vision)
    plan = plan_resize(image.height, image.width, vision, limits)
    return enc.pixel_values(enc.resize(image, plan)), plan


def test_the_comparison_is_with_the_pil_processor(hf_processor) -> None:
    assert type(hf_processor).__name__ == "Qwen2VLImageProcessorPil"


def test_contract_example_512x341(vision) -> None:
    pixels, plan = _ours(vision, make_image(512, 341))
    assert (plan.width, plan.height) == (512, 352)
    assert plan.grid_thw == (1, 22, 32)
    assert pixels.shape == (704, 1536) and pixels.dtype == np.float32
    assert plan.num_patches // vision.merge_size**2 == 176


@pytest.mark.parametrize(
    ("engine_dtype", "pixel_dtype"),
    [
        ("auto", "bfloat16"),  # the tiny checkpoint is bfloat16, like Qwen3-VL's
        ("bfloat16", "bfloat16"),
        ("half", "float16"),
        ("float16", "float16"),
        ("float32", "float32"),
    ],
)
def test_pixel_dtype_follows_the_engine_dtype(checkpoint: Path, engine_dtype: str, pixel_dtype: str) -> None:
    assert CheckpointFiles.load(checkpoint, engine_dtype=engine_dtype).vision.pixel_dtype == pixel_dtype


@pytest.mark.parametrize(
    ("declared", "auto"),
    [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "bfloat16"), (None, "bfloat16")],
)
def test_auto_resolves_the_checkpoint_dtype_like_vllm(
    checkpoint: Path, tmp_path: Path, declared: str | None, auto: str
) -> None:
    """vLLM's `--dtype auto`: a 16-bit checkpoint keeps its dtype; float32 runs in bfloat16."""
    import json
    import shutil

    copy = shutil.copytree(checkpoint, tmp_path / "ckpt")
    config = json.loads((copy / "config.json").read_text())
    for section in (config, config.get("text_config") or {}, config.get("vision_config") or {}):
        section.pop("dtype", None), section.pop("torch_dtype", None)
    if declared:
        config["text_config"]["dtype"] = declared
    (copy / "config.json").write_text(json.dumps(config))
    assert CheckpointFiles.load(copy).vision.pixel_dtype == auto


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_pixels_are_the_float32_ones_cast_like_torch(checkpoint: Path, vision, dtype: str) -> None:
    """What vLLM sends: the processor's float32 values cast to the model dtype (round to
    nearest even), computed here straight from the lookup table."""
    image = make_image(512, 341, seed=3)
    narrow, _ = _ours(CheckpointFiles.load(checkpoint, engine_dtype=dtype).vision, image)
    wide, _ = _ours(vision, image)
    cast = mm_serde.to_bfloat16(wide) if dtype == "bfloat16" else wide.astype(np.float16)
    assert narrow.dtype == cast.dtype
    np.testing.assert_array_equal(narrow.view(np.uint16), cast.view(np.uint16))


def test_exif_orientation_is_applied_on_decode(vision) -> None:
    """A phone photo stored 512x341 with Orientation=6 (rotate 90° clockwise to display) is
    encoded upright, as vLLM does: 341 wide, 512 high, grid [1, 32, 22]."""
    import io

    from PIL import Image

    image = make_image(512, 341, seed=4)
    exif = image.getexif()
    exif[0x0112] = 6
    jpeg = encode_image(image, "JPEG", exif=exif.tobytes(), quality=95)
    upright = decode_image(jpeg, Limits())
    stored = Image.open(io.BytesIO(jpeg)).convert("RGB")
    assert stored.size == (512, 341)
    assert upright.tobytes() == stored.transpose(Image.Transpose.ROTATE_270).tobytes()
    assert plan_resize(upright.height, upright.width, vision, Limits()).grid_thw == (1, 32, 22)


@pytest.mark.parametrize("size", [(512, 341), (224, 224), (1000, 333), (64, 900), (100, 100), (1280, 720)])
def test_pixel_values_match_transformers(vision, hf_processor, size: tuple[int, int]) -> None:
    image = make_image(*size, seed=sum(size))
    ours, plan = _ours(vision, image)
    theirs = hf_processor(images=[image])
    assert [list(plan.grid_thw)] == theirs["image_grid_thw"].tolist()
    np.testing.assert_array_equal(ours, theirs["pixel_values"])  # bit-identical, not just close


def test_downscale_matches_transformers_with_the_budget_as_max_pixels(vision, hf_processor) -> None:
    image = make_image(1024, 768, seed=7)
    limits = Limits(max_image_patches=1024)
    ours, plan = _ours(vision, image, limits)
    assert plan.downscaled_for_budget and plan.num_patches <= 1024
    theirs = hf_processor(images=[image], size={"shortest_edge": 65536, "longest_edge": 1024 * 256})
    assert [list(plan.grid_thw)] == theirs["image_grid_thw"].tolist()
    np.testing.assert_array_equal(ours, theirs["pixel_values"])  # bit-identical, not just close


def test_reject_over_budget(vision) -> None:
    limits = Limits(max_image_patches=1024, oversized_image="reject")
    plan_resize(512, 512, vision, limits)  # exactly 1024 patches: fits
    with pytest.raises(ImageOverBudget, match=r"512x544 resizes to 512x544 = 1088 patches .* budget of 1024"):
        plan_resize(544, 512, vision, limits)


@pytest.mark.parametrize(("h", "w", "budget"), [(32, 6000, 64), (4000, 3000, 16), (5000, 5000, 1024), (33, 6599, 300)])
def test_downscale_always_fits_the_budget(vision, h: int, w: int, budget: int) -> None:
    plan = plan_resize(h, w, vision, Limits(max_image_patches=budget))
    assert plan.num_patches <= budget
    assert plan.height % 32 == 0 and plan.width % 32 == 0


def test_smart_resize_rules() -> None:
    kw = {"factor": 32, "min_pixels": 65536, "max_pixels": 16777216}
    assert smart_resize(341, 512, **kw) == (352, 512)  # round to multiples of 32
    assert smart_resize(100, 100, **kw) == (256, 256)  # grown to min_pixels, ceil
    assert smart_resize(8000, 8000, **kw) == (4096, 4096)  # shrunk to max_pixels, floor
    with pytest.raises(ImageDimensionsRejected, match="aspect ratio"):
        smart_resize(10, 2500, **kw)


def test_decode_converts_to_rgb_and_composites_alpha_on_white() -> None:
    from PIL import Image

    rgba = Image.new("RGBA", (40, 30), (10, 20, 30, 0))  # fully transparent
    out = decode_image(encode_image(rgba), Limits())
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (255, 255, 255)
    gray = decode_image(encode_image(make_image(40, 30, mode="L")), Limits())
    assert gray.mode == "RGB"
    pal = decode_image(encode_image(make_image(40, 30).convert("P")), Limits())
    assert pal.mode == "RGB"


def test_first_frame_of_an_animation() -> None:
    frames = [make_image(32, 32, seed=s) for s in range(3)]
    data = encode_image(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(data, Limits()).size == (32, 32)
