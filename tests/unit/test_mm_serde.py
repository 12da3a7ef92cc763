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
    # vLLM 0.24's Qwen2-VL field configs, as its mm_serde writes them
    assert doc["pixel_values"]["field"] == ["flat", {"keep_on_cpu": False, "slices": [[[0, 704, None]]], "dim": 0}]
    assert doc["image_grid_thw"]["field"] == ["batched", {"keep_on_cpu": True}]
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
                msgpack.packb(
                    {"x": {"data": ["float32", [2], msgpack.ExtType(3, b"\0" * 4)], "field": ["batched", {}]}}
                )
            ).decode(),
            "do not match shape",
        ),
        (
            base64.b64encode(
                msgpack.packb(
                    {"x": {"data": ["float32", [1], msgpack.ExtType(1, b"\0" * 4)], "field": ["batched", {}]}}
                )
            ).decode(),
            "extension type 1",
        ),
    ],
)
def test_bad_input_is_refused_with_a_reason(text, message):
    with pytest.raises(m.MMSerdeError, match=message):
        m.decode_item_b64(text)


def test_bfloat16_round_trip_keeps_the_words():
    pixels = np.random.default_rng(0).standard_normal((16, 1536)).astype(np.float32)
    words = m.to_bfloat16(pixels)
    doc = msgpack.unpackb(m.encode_item(m.qwen_vl_item(words, (1, 4, 4))), raw=False)
    dtype, shape, ext = doc["pixel_values"]["data"]
    assert (dtype, shape, len(ext.data)) == ("bfloat16", [16, 1536], 16 * 1536 * 2)
    back = m.decode_item(m.encode_item(m.qwen_vl_item(words, (1, 4, 4))))["pixel_values"].data
    assert back.dtype == m.BFLOAT16 and back.tobytes() == words.tobytes()
    np.testing.assert_allclose(m.as_float32(back), pixels, rtol=2**-8)  # 8 significant bits


@pytest.mark.parametrize(
    ("value", "word"),
    [
        (1.0, 0x3F80),
        (1.0 + 2**-8, 0x3F80),  # halfway, even neighbour below
        (1.0 + 3 * 2**-8, 0x3F82),  # halfway, even neighbour above
        (1.0 + 2**-8 + 2**-20, 0x3F81),  # above halfway rounds up
        (-2.5, 0xC020),
        (float("inf"), 0x7F80),
        (3.4e38, 0x7F80),  # rounds past the largest bfloat16: inf, as torch does
        (1e-40, 0x0001),  # subnormals keep their top bits
    ],
)
def test_to_bfloat16_rounds_to_nearest_even_like_torch(value, word):
    assert int(m.to_bfloat16(np.array([value], np.float32)).view(np.uint16)[0]) == word


def test_bfloat16_nan_stays_nan():
    assert np.isnan(m.as_float32(m.to_bfloat16(np.array([np.nan], np.float32))))[0]


def test_as_float32_reads_every_float_wire_dtype():
    values = np.array([0.5, -1.25, 3.0], np.float32)
    for wire in (values, values.astype(np.float16), m.to_bfloat16(values)):
        np.testing.assert_array_equal(m.as_float32(wire), values)


@pytest.mark.parametrize("nbytes", [1, 2, 3, 4, 8, 16, 17, 255, 256, 65535, 65536, 70_001])
def test_encoding_is_byte_for_byte_msgpack(nbytes):
    """Our one-pass writer against msgpack's own packer, across every ext header form."""
    data = np.frombuffer(np.random.default_rng(nbytes).bytes(nbytes), dtype=np.uint8)
    item = {
        "pixel_values": m.FieldElem(data, m.FieldSpec.flat(0, nbytes)),
        "nothing": m.FieldElem(None, m.FieldSpec("shared")),
        "image_grid_thw": m.FieldElem(np.asarray([1, 2, 3], np.int64), m.FieldSpec.batched(keep_on_cpu=True)),
    }
    doc = {
        key: {
            "data": None
            if elem.data is None
            else [m._NAMES[elem.data.dtype], list(elem.data.shape), msgpack.ExtType(3, elem.data.tobytes())],
            "field": [elem.spec.factory, elem.spec.kwargs],
        }
        for key, elem in item.items()
    }
    assert m.encode_item(item) == msgpack.packb(doc, use_bin_type=True)


def test_a_tensor_slot_is_filled_in_place_and_aligned():
    pixels = m.to_bfloat16(np.random.default_rng(3).standard_normal((64, 1536)).astype(np.float32))
    buf, views = m.encode_item_in_place(m.qwen_vl_item(m.TensorSlot(m.BFLOAT16, (64, 1536)), (1, 8, 8)))
    view = views["pixel_values"]
    assert view.shape == (64, 1536) and view.dtype == m.BFLOAT16
    assert view.ctypes.data % 64 == 0  # numpy's fast paths
    view[...] = pixels
    assert bytes(buf) == m.encode_item(m.qwen_vl_item(pixels, (1, 8, 8)))
    assert m.b64(buf) == base64.b64encode(bytes(buf))


def test_an_unfilled_slot_cannot_be_encoded_by_value():
    with pytest.raises(m.MMSerdeError, match="in place"):
        m.encode_item(m.qwen_vl_item(m.TensorSlot(m.BFLOAT16, (4, 1536)), (1, 2, 2)))
