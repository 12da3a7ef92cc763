"""How a prepared image becomes `kwargs_data` (docs/contract.md §2.5), behind a protocol.

The default encoder is our own mm_serde codec (epd_kit.mm_serde); production can plug in an
encoder built on vLLM's `mm_serde.encode_mm_kwargs_item` without touching the pipeline.

A VE item is megabytes, so the encoder owns the buffer the pixel values are written into:
it hands `fill` an array to write them in, and ours makes that array a view of the
serialized document itself (pixels computed once, straight into the bytes that are
base64-encoded; no copy in between).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np

from .. import mm_serde

PixelFill = Callable[[np.ndarray], object]  # writes pixel_values into the array it is given


class ItemEncoder(Protocol):
    def encode_ve(
        self, grid_thw: tuple[int, int, int], shape: tuple[int, int], dtype: np.dtype, fill: PixelFill
    ) -> bytes:
        """The full item for a VE (pixel_values + image_grid_thw) as base64 ASCII bytes;
        `fill(out)` writes pixel_values of `shape` and `dtype` into `out`."""

    def encode_pd(self, grid_thw: tuple[int, int, int]) -> str:
        """The LM-only item for a PD: image_grid_thw (M-RoPE)."""


class MmSerdeEncoder:
    """Qwen-VL items through epd_kit.mm_serde (base64 msgpack, tensors inline). Each worker
    thread builds its documents in one reused scratch buffer (megabytes of fresh memory per
    image cost more in page faults than the encoding itself); only the base64 result, which
    the cache keeps, is new memory."""

    def __init__(self) -> None:
        self._scratch = threading.local()

    def encode_ve(
        self, grid_thw: tuple[int, int, int], shape: tuple[int, int], dtype: np.dtype, fill: PixelFill
    ) -> bytes:
        item = mm_serde.qwen_vl_item(mm_serde.TensorSlot(np.dtype(dtype), shape), grid_thw)
        buf, views = mm_serde.encode_item_in_place(item, self._scratch_for(mm_serde.item_size(item)))
        fill(views["pixel_values"])
        return mm_serde.b64(buf)

    def _scratch_for(self, size: int) -> np.ndarray:
        """This thread's buffer, grown to fit (images are bounded by limits.max_image_patches)."""
        scratch: np.ndarray | None = getattr(self._scratch, "buffer", None)
        if scratch is None or scratch.size < mm_serde.scratch_bytes(size):
            scratch = self._scratch.buffer = np.empty(mm_serde.scratch_bytes(size), np.uint8)
        return scratch

    def encode_pd(self, grid_thw: tuple[int, int, int]) -> str:
        no_pixels = mm_serde.TensorSlot(np.dtype(np.float32), (0, 0))  # stripped by lm_only
        return mm_serde.encode_item_b64(mm_serde.lm_only(mm_serde.qwen_vl_item(no_pixels, grid_thw)))
