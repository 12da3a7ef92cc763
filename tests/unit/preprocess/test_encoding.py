"""Item encoding: pluggable, with vLLM's layout (tests/compat checks it against vLLM's own
mm_serde byte for byte)."""

from __future__ import annotations

import numpy as np

from epd_kit import mm_serde
from epd_kit.testing.images import image_part, png_data_url, user_message


class RecordingEncoder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, int, int], tuple[int, ...]]] = []

    def encode_ve(self, grid_thw, shape, dtype, fill) -> bytes:
        pixels = np.zeros(shape, dtype)
        fill(pixels)
        self.calls.append(("ve", grid_thw, pixels.shape))
        return f"ve:{grid_thw}".encode()

    def encode_pd(self, grid_thw: tuple[int, int, int]) -> str:
        self.calls.append(("pd", grid_thw, ()))
        return f"pd:{grid_thw}"


async def test_a_plugged_in_encoder_produces_the_wire_strings(make_preprocessor) -> None:
    enc = RecordingEncoder()
    pre = make_preprocessor(encoder=enc)
    rendered = await pre.render([user_message(image_part(png_data_url(512, 341)))])
    assert enc.calls == [("ve", (1, 22, 32), (704, 1536)), ("pd", (1, 22, 32), ())]
    assert (rendered.items[0].ve_kwargs_b64, rendered.items[0].pd_kwargs_b64) == ("ve:(1, 22, 32)", "pd:(1, 22, 32)")


async def test_default_encoding_layout(pre) -> None:
    item = (await pre.render([user_message(image_part(png_data_url(64, 64)))])).items[0]
    ve = mm_serde.decode_item_b64(item.ve_kwargs_b64)
    assert list(ve) == ["pixel_values", "image_grid_thw"]
    assert ve["pixel_values"].data.dtype == mm_serde.BFLOAT16  # the tiny checkpoint's dtype
    assert ve["pixel_values"].spec.kwargs["slices"] == [[[0, item.num_patches, None]]]
    assert ve["image_grid_thw"].data.dtype == np.int64
    assert ve["image_grid_thw"].spec == mm_serde.FieldSpec("batched", {"keep_on_cpu": True})
    pd = mm_serde.decode_item_b64(item.pd_kwargs_b64)
    assert list(pd) == ["image_grid_thw"] and pd["image_grid_thw"].spec == ve["image_grid_thw"].spec


def test_default_encoder_equals_the_shared_codec() -> None:
    from epd_kit.preprocess import MmSerdeEncoder

    pixels = np.random.default_rng(1).standard_normal((16, 1536)).astype(np.float32)
    item = mm_serde.qwen_vl_item(pixels, (1, 4, 4))
    enc = MmSerdeEncoder()
    ve = enc.encode_ve((1, 4, 4), pixels.shape, pixels.dtype, lambda out: np.copyto(out, pixels))
    assert ve.decode() == mm_serde.encode_item_b64(item)
    assert enc.encode_pd((1, 4, 4)) == mm_serde.encode_item_b64(mm_serde.lm_only(item))
