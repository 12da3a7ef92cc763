"""vLLM `mm_serde`-compatible codec for one MultiModalKwargsItem (docs/contract.md §2.5).

Wire value = base64 (standard alphabet) of one msgpack document:

    {field_key: {"data": [dtype, shape, ExtType(3, raw little-endian bytes)],
                 "field": [factory_name, {dataclass field: value, ...}]}}

with every tensor inline (ext type 3, vLLM's CUSTOM_TYPE_RAW_VIEW), dtype without the
"torch." prefix, and a `flat` field's slices as [start, stop, step] arrays. numpy stands in
for torch: the bytes are the same for the same dtype and shape.

The encoder writes the document in one buffer, each tensor's bytes copied once; a tensor
given only as a `TensorSlot` (dtype and shape) is left for the caller to fill in place
(`encode_item_in_place`), so the router's pixel values are computed straight into the
buffer that is then base64-encoded: no intermediate copy of megabytes.

numpy has no bfloat16, the dtype vLLM sends pixel_values in for a bfloat16 engine. Such a
tensor travels here as its raw 16-bit words under the structured dtype `BFLOAT16`, which
numpy refuses to do arithmetic on, so the words are never mistaken for integers:
`to_bfloat16` makes them (round to nearest even, as torch does), `as_float32` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

try:  # SIMD base64, what vLLM's own mm_serde uses; an item is megabytes of base64
    from pybase64 import b64decode as _b64decode
    from pybase64 import b64encode as _b64encode
except ImportError:  # pragma: no cover - same results, several times slower
    from base64 import b64decode as _b64decode
    from base64 import b64encode as _b64encode

RAW_VIEW_EXT = 3  # vLLM CUSTOM_TYPE_RAW_VIEW
_ALIGN = 64  # bytes: where an in-place tensor starts (a cache line)

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
class TensorSlot:
    """A tensor to be written in place after encoding: its wire dtype and shape only."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class FieldElem:
    data: np.ndarray | TensorSlot | None
    spec: FieldSpec


MMItem = dict[str, FieldElem]


def _wire_dtype(dtype: np.dtype) -> tuple[str, np.dtype]:
    """(torch name, little-endian numpy dtype) of a tensor's dtype."""
    le = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    name = _NAMES.get(np.dtype(le))
    if name is None:
        raise MMSerdeError(f"dtype {dtype} has no torch equivalent on the wire")
    return name, np.dtype(le)


def _ext_header(size: int) -> bytes:
    """msgpack's header of an extension of `size` bytes, type 3, in the smallest form (as
    msgpack.packb writes it: fixext 1/2/4/8/16, else ext 8/16/32)."""
    fixext = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if size in fixext:
        return bytes((fixext[size], RAW_VIEW_EXT))
    if size < 1 << 8:
        return bytes((0xC7, size, RAW_VIEW_EXT))
    if size < 1 << 16:
        return b"\xc8" + size.to_bytes(2, "big") + bytes((RAW_VIEW_EXT,))
    return b"\xc9" + size.to_bytes(4, "big") + bytes((RAW_VIEW_EXT,))


def _layout(item: MMItem) -> tuple[list[bytes | np.ndarray | TensorSlot], int]:
    """The document as msgpack pieces (bytes) between raw tensors (arrays or slots to fill),
    and its total size; fields in the given (processor) order."""
    packer = msgpack.Packer(use_bin_type=True)
    pieces: list[bytes | np.ndarray | TensorSlot] = []
    head = bytearray(packer.pack_map_header(len(item)))
    for key, elem in item.items():
        head += packer.pack(key) + packer.pack_map_header(2) + packer.pack("data")
        if elem.data is None:
            head += packer.pack(None)
        else:
            if isinstance(elem.data, TensorSlot):
                name, dtype = _wire_dtype(elem.data.dtype)
                shape, raw = elem.data.shape, TensorSlot(dtype, tuple(elem.data.shape))
            else:
                name, dtype = _wire_dtype(elem.data.dtype)
                shape, raw = elem.data.shape, np.ascontiguousarray(elem.data).astype(dtype, copy=False)
            head += packer.pack_array_header(3) + packer.pack(name) + packer.pack(list(shape))
            head += _ext_header(raw.nbytes)
            pieces += [bytes(head), raw]
            head = bytearray()
        head += packer.pack("field") + packer.pack([elem.spec.factory, elem.spec.kwargs])
    pieces.append(bytes(head))
    return pieces, sum(p.nbytes if not isinstance(p, bytes) else len(p) for p in pieces)


def encode_item_in_place(item: MMItem, scratch: np.ndarray | None = None) -> tuple[memoryview, dict[str, np.ndarray]]:
    """The item's msgpack document in one buffer, plus a writable view of the buffer for each
    `TensorSlot` field: the caller fills those views before using the buffer. The first
    tensor starts on a 64-byte boundary (numpy writes to misaligned memory several times
    slower), which is why the document sits at an offset inside a larger allocation.
    `scratch`: a uint8 array to build it in when it is large enough (`scratch_bytes`), so a
    caller that encodes item after item reuses memory instead of faulting in fresh pages;
    the result is then only valid until the caller's next use of `scratch`."""
    pieces, size = _layout(item)
    first_tensor = len(pieces[0]) if len(pieces) > 1 else 0
    fits = scratch is not None and scratch.size >= scratch_bytes(size)
    raw = scratch if fits else np.empty(scratch_bytes(size), np.uint8)
    start = (-(raw.ctypes.data + first_tensor)) % _ALIGN
    doc = raw[start : start + size]
    views: dict[str, np.ndarray] = {}
    slots = iter(key for key, elem in item.items() if isinstance(elem.data, TensorSlot))
    pos = 0
    for piece in pieces:
        if isinstance(piece, bytes):
            doc[pos : pos + len(piece)] = np.frombuffer(piece, np.uint8)
            pos += len(piece)
            continue
        region = doc[pos : pos + piece.nbytes]
        if isinstance(piece, TensorSlot):
            views[next(slots)] = region.view(piece.dtype).reshape(piece.shape)
        else:
            region[:] = piece.reshape(-1).view(np.uint8)
        pos += piece.nbytes
    return memoryview(doc), views


def scratch_bytes(size: int) -> int:
    """The scratch size a document of `size` bytes needs (room to align its first tensor)."""
    return size + _ALIGN


def item_size(item: MMItem) -> int:
    """The encoded size of an item in bytes (TensorSlots counted at their full size)."""
    return _layout(item)[1]


def encode_item(item: MMItem) -> bytes:
    """msgpack bytes of one item, fields in the given (processor) order; byte for byte what
    `msgpack.packb` makes of the document."""
    if any(isinstance(elem.data, TensorSlot) for elem in item.values()):
        raise MMSerdeError("a TensorSlot must be filled in place (encode_item_in_place)")
    return bytes(encode_item_in_place(item)[0])


def b64(blob: bytes | memoryview) -> bytes:
    """Standard padded base64 of an encoded item, as ASCII bytes (what `kwargs_data` holds)."""
    return _b64encode(blob)


def encode_item_b64(item: MMItem) -> str:
    return b64(encode_item_in_place(item)[0]).decode("ascii")


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


def decode_item_b64(text: str | bytes) -> MMItem:
    try:
        blob = _b64decode(text, validate=True)
    except Exception as exc:
        raise MMSerdeError(f"kwargs_data is not valid base64: {exc}") from exc
    return decode_item(blob)


# --- Qwen3-VL items (docs/contract.md §2.5): pixel_values (flat) + image_grid_thw (batched) ---


def qwen_vl_item(pixel_values: np.ndarray | TensorSlot, grid_thw: tuple[int, int, int]) -> MMItem:
    """The full item a VE receives, with vLLM's field configs (Qwen2-VL's
    `_field_config`: the grid stays on the CPU, it only steers the encoder). A TensorSlot
    for the pixels: encode it with `encode_item_in_place` and write them there."""
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
