"""Operator settings for request input: the `limits` and `media` sections of router.yaml.

One model for both readers: the router's config file embeds these sections as they are
(docs/architecture.md "Router config file") and hands them to the preprocessor unchanged.
Unknown keys are errors, so a typo in router.yaml is reported instead of ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Section(BaseModel):
    """A router.yaml section: immutable, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(Section):
    images_per_prompt: int = Field(default=30, ge=0)
    # Raw 16-px patches one image may produce (= vision_attention_block_size on the engines).
    max_image_patches: int = Field(default=1024, gt=0)
    oversized_image: Literal["downscale", "reject"] = "downscale"
    # The HTTP request body (checked by the router before parsing).
    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    max_image_bytes: int = Field(default=20 * 1024 * 1024, gt=0)
    # Decompression-bomb guard, checked from the header before any pixel is decoded.
    max_image_pixels: int = Field(default=8192 * 8192, gt=0)
    # Prepared-image LRU (by mm_hash); the byte bound is what limits memory (0 disables).
    image_cache_items: int = Field(default=256, ge=0)
    image_cache_bytes: int = Field(default=1024 * 1024 * 1024, ge=0)


class Media(Section):
    """Where images may come from. data: URLs are always allowed; http(s) only if enabled
    and the host is listed: the router must not become a tool to reach internal hosts."""

    allow_http: bool = False
    # Exact host names or "host:port" entries; no wildcards; compared lower-case.
    allowed_hosts: list[str] = Field(default_factory=list)
    fetch_timeout_s: float = Field(default=10.0, gt=0)
    max_redirects: int = Field(default=3, ge=0, le=10)

    @field_validator("allowed_hosts")
    @classmethod
    def _lower(cls, hosts: list[str]) -> list[str]:
        return [h.strip().lower() for h in hosts]
