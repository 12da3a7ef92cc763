"""vLLM `mm_serde`-compatible codec for one MultiModalKwargsItem (docs/contract.md §2.5).

Wire value = base64 (standard alphabet) of one msgpack document:

    {field_key: {"data": [dtype, shape, ExtType(3, raw little-endian bytes)],
                 "field": [factory_name, {dataclass field: value, ...}]}}

with every tensor inline (ext type 3, vLLM's CUSTOM_TYPE_RAW_VIEW), dtype without the
"torch." prefix, and a `flat` field's slices as [start, stop, step] arrays. numpy stands in
for torch: the bytes are the same for the same dtype and shape.

numpy has no bfloat16, the dtype vLLM sends pixel_values in for a bfloat16 engine. Such a
tensor travels here as its raw 16-bit words under the structured dtype `BFLOAT16`, which
numpy refuses to do arithmetic on, so the words are never mistaken for integers:
`to_bfloat16` makes them (round to nearest even, as torch does), `as_float32` reads them.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

RAW_VIEW_EXT = 3  # vLLM CUSTOM_TYPE_RAW_VIEW

BFLOAT16 = np.dtype([("bfloat16", "<u2")])  # torch.bfloat16 as raw little-endian words

# torch dtype names (as vLLM writes them) <-> numpy dtypes
_DTYPES: dict[str, np.dtype] = {
    "bfloat16": BFLOAT16,
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "float16": np.dtype("<f2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class MMSerdeError(ValueError):
    """A kwargs_data value that is not a valid mm_serde item."""


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 -> BFLOAT16 words, rounded to nearest even like torch's cast (NaN stays NaN)."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    words = np.where(np.isnan(values), np.uint32(0x7FC0), rounded).astype("<u2")
    return words.view(BFLOAT16)


def as_float32(values: np.ndarray) -> np.ndarray:
    """A float tensor of any wire dtype (BFLOAT16 words included) as float32 values."""
    if values.dtype == BFLOAT16:
        return (values.view("<u2").astype("<u4") << 16).view("<f4")
    return values.astype("<f4", copy=False)


@dataclass(frozen=True)
class FieldSpec:
    """How vLLM rebuilds the field on the other side (`MultiModalFieldConfig.<factory>`)."""

    factory: str  # "flat" | "batched" | "shared"
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def batched(cls, *, keep_on_cpu: bool = False) -> FieldSpec:
        return cls("batched", {"keep_on_cpu": keep_on_cpu})

    @classmethod
    def flat(cls, start: int, stop: int, dim: int = 0) -> FieldSpec:
        """One item's share of a flat field, written as vLLM 0.24 writes it: a list of
        slice tuples, each a list of [start, stop, step] (one tuple, one slice here)."""
        return cls("flat", {"keep_on_cpu": False, "slices": [[[start, stop, None]]], "dim": dim})


@dataclass(frozen=True)
class FieldElem:
    data: np.ndarray | None
    spec: FieldSpec


MMItem = dict[str, FieldElem]


def _encode_tensor(arr: np.ndarray) -> list[Any]:
    arr = np.ascontiguousarray(arr)
    le = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    name = _NAMES.get(np.dtype(le))
    if name is None:
        raise MMSerdeError(f"dtype {arr.dtype} has no torch equivalent on the wire")
    return [name, list(arr.shape), msgpack.ExtType(RAW_VIEW_EXT, arr.astype(le, copy=False).tobytes())]


def encode_item(item: MMItem) -> bytes:
    """msgpack bytes of one item, fields in the given (processor) order."""
    doc = {
        key: {
            "data": None if elem.data is None else _encode_tensor(elem.data),
            "field": [elem.spec.factory, elem.spec.kwargs],
        }
        for key, elem in item.items()
    }
    return msgpack.packb(doc, use_bin_type=True)


def encode_item_b64(item: MMItem) -> str:
    return base64.b64encode(encode_item(item)).decode("ascii")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != RAW_VIEW_EXT:
        raise MMSerdeError(f"msgpack extension type {code} is not allowed (only inline tensors)")
    return bytes(data)


def _decode_tensor(obj: Any, key: str) -> np.ndarray:
    if not (isinstance(obj, list) and len(obj) == 3 and isinstance(obj[0], str)):
        raise MMSerdeError(f"field {key!r}: expected [dtype, shape, data]")
    dtype_name, shape, raw = obj
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise MMSerdeError(f"field {key!r}: unsupported dtype {dtype_name!r}")
    if not isinstance(raw, bytes):
        raise MMSerdeError(f"field {key!r}: tensor bytes must be inline (ext type 3)")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise MMSerdeError(f"field {key!r}: bad shape {shape!r}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise MMSerdeError(
            f"field {key!r}: {len(raw)} bytes do not match shape {shape} of {dtype_name} ({expected} bytes)"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def decode_item(blob: bytes) -> MMItem:
    try:
        doc = msgpack.unpackb(blob, raw=False, ext_hook=_ext_hook, strict_map_key=True)
    except MMSerdeError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise MMSerdeError(f"not a msgpack document: {exc}") from exc
    if not isinstance(doc, dict):
        raise MMSerdeError("an mm item must be a msgpack map of field name -> element")
    item: MMItem = {}
    for key, elem in doc.items():
        if not (isinstance(elem, dict) and "field" in elem and "data" in elem):
            raise MMSerdeError(f"field {key!r}: expected {{'data', 'field'}}")
        factory, kwargs = elem["field"]
        data = None if elem["data"] is None else _decode_tensor(elem["data"], key)
        item[key] = FieldElem(data=data, spec=FieldSpec(factory, dict(kwargs)))
    return item


def decode_item_b64(text: str) -> MMItem:
    try:
        blob = base64.b64decode(text, validate=True)
    except Exception as exc:
        raise MMSerdeError(f"kwargs_data is not valid base64: {exc}") from exc
    return decode_item(blob)


# --- Qwen3-VL items (docs/contract.md §2.5): pixel_values (flat) + image_grid_thw (batched) ---


def qwen_vl_item(pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> MMItem:
    """The full item a VE receives, with vLLM's field configs (Qwen2-VL's
    `_field_config`: the grid stays on the CPU, it only steers the encoder)."""
    n = int(pixel_values.shape[0])
    return {
        "pixel_values": FieldElem(pixel_values, FieldSpec.flat(0, n)),
        "image_grid_thw": FieldElem(np.asarray(grid_thw, dtype=np.int64), FieldSpec.batched(keep_on_cpu=True)),
    }


def lm_only(item: MMItem) -> MMItem:
    """What a PD receives: encoder-only tensors stripped (docs/contract.md §5.5, `get_epd_kwargs`)."""
    return {k: v for k, v in item.items() if k == "image_grid_thw"}


def grid_thw(item: MMItem) -> tuple[int, int, int]:
    elem = item.get("image_grid_thw")
    if elem is None or elem.data is None or elem.data.shape != (3,):
        raise MMSerdeError("item has no image_grid_thw of shape [3]")
    t, h, w = (int(x) for x in elem.data)
    return t, h, w
