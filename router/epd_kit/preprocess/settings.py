"""Operator settings for preprocessing: the `limits` and `media` sections of router.yaml.

Field names match the router config (docs/architecture.md), and unknown keys are ignored,
so the router can pass its sections straight in:
``PreprocessLimits.model_validate(cfg.limits.model_dump())``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Settings(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class PreprocessLimits(_Settings):
    images_per_prompt: int = Field(default=30, ge=0)
    # Raw 16-px patches one image may produce (= vision_attention_block_size on the engines).
    max_image_patches: int = Field(default=1024, gt=0)
    oversized_image: Literal["downscale", "reject"] = "downscale"
    max_image_bytes: int = Field(default=20 * 1024 * 1024, gt=0)
    # Decompression-bomb guard, checked from the header before any pixel is decoded.
    max_image_pixels: int = Field(default=8192 * 8192, gt=0)


class MediaPolicy(_Settings):
    """Where images may come from. data: URLs are always allowed; http(s) only if enabled
    and the host is listed: the router must not become a tool to reach internal hosts."""

    allow_http: bool = False
    # Exact host names or "host:port" entries; no wildcards.
    allowed_hosts: tuple[str, ...] = ()
    fetch_timeout_s: float = Field(default=10.0, gt=0)
    max_redirects: int = Field(default=3, ge=0, le=10)

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        if isinstance(value, (list, tuple)):
            return tuple(str(h).strip().lower() for h in value)
        return value
