"""mm_serde codec: round trips, the Qwen3-VL item layout, and refusal of bad input."""

import base64

import msgpack
import numpy as np
import pytest

from epd_kit import mm_serde as m


def test_qwen_item_round_trip_and_layout():
    pixels = np.arange(704 * 1536, dtype=np.float32).reshape(704, 1536)
    blob = m.encode_item(m.qwen_vl_item(pixels, (1, 22, 32)))
    doc = msgpack.unpackb(blob, raw=False)
    assert list(doc) == ["pixel_values", "image_grid_thw"]
    dtype, shape, ext = doc["pixel_values"]["data"]
    assert (dtype, shape) == ("float32", [704, 1536])
    assert isinstance(ext, msgpack.ExtType) and ext.code == 3 and len(ext.data) == 704 * 1536 * 4
    assert doc["pixel_values"]["field"] == ["flat", {"keep_on_cpu": False, "slices": [[0, 704, None]], "dim": 0}]
    assert doc["image_grid_thw"]["field"] == ["batched", {"keep_on_cpu": False}]
    item = m.decode_item(blob)
    assert m.grid_thw(item) == (1, 22, 32)
    np.testing.assert_array_equal(item["pixel_values"].data, pixels)


def test_lm_only_strips_pixels():
    item = m.qwen_vl_item(np.zeros((16, 1536), np.float32), (1, 4, 4))
    lm = m.decode_item_b64(m.encode_item_b64(m.lm_only(item)))
    assert list(lm) == ["image_grid_thw"] and m.grid_thw(lm) == (1, 4, 4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not base64!!", "not valid base64"),
        (base64.b64encode(b"\xc1").decode(), "not a msgpack document"),
        (base64.b64encode(msgpack.packb([1, 2])).decode(), "must be a msgpack map"),
        (
            base64.b64encode(
                msgpack.packb({"x": {"data": ["float32", [2], msgpack.ExtType(3, b"\0" * 4)], "field": ["batched", {}]}})
            ).decode(),
            "do not match shape",
        ),
        (
            base64.b64encode(
                msgpack.packb({"x": {"data": ["float32", [1], msgpack.ExtType(1, b"\0" * 4)], "field": ["batched", {}]}})
            ).decode(),
            "extension type 1",
        ),
    ],
)
def test_bad_input_is_refused_with_a_reason(text, message):
    with pytest.raises(m.MMSerdeError, match=message):
        m.decode_item_b64(text)
