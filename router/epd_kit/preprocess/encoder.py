"""How a prepared image becomes `kwargs_data` strings (docs/contract.md §2.5), behind a protocol.

The default encoder is our own mm_serde codec (epd_kit.mm_serde); production can plug in an
encoder built on vLLM's `mm_serde.encode_mm_kwargs_item` without touching the pipeline.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .. import mm_serde

try:  # SIMD base64, what vLLM itself uses; a VE item is megabytes of base64
    from pybase64 import b64encode_as_string as _b64
except ImportError:  # pragma: no cover - same output, slower
    import base64

    def _b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")


class ItemEncoder(Protocol):
    def encode_ve(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> str:
        """The full item for a VE: pixel_values + image_grid_thw."""

    def encode_pd(self, grid_thw: tuple[int, int, int]) -> str:
        """The LM-only item for a PD: image_grid_thw (M-RoPE)."""


class MmSerdeEncoder:
    """Qwen-VL items through epd_kit.mm_serde (base64 msgpack, tensors inline)."""

    def encode_ve(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> str:
        return _b64(mm_serde.encode_item(mm_serde.qwen_vl_item(pixel_values, grid_thw)))

    def encode_pd(self, grid_thw: tuple[int, int, int]) -> str:
        item = mm_serde.qwen_vl_item(np.zeros((0, 0), dtype=np.float32), grid_thw)
        return _b64(mm_serde.encode_item(mm_serde.lm_only(item)))
