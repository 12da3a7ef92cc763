"""Operator settings for request input: the `limits` and `media` sections of router.yaml.

One model for both readers: the router's config file embeds these sections as they are
(docs/architecture.md "Router config file") and hands them to the preprocessor unchanged.
Unknown keys are errors, so a typo in router.yaml is reported instead of ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..plan.variables import IMAGES_PER_PROMPT  # relative: loaded under the collection's private name too


class Section(BaseModel):
    """A router.yaml section: immutable, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# The formats `limits.image_formats` may list: single-image raster formats of Pillow with a
# header parsed without decoding. Deliberately absent: EPS/PS/PDF (Ghostscript) and the rest.
ImageFormat = Literal["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"]


class Limits(Section):
    images_per_prompt: int = Field(default=IMAGES_PER_PROMPT, ge=0)  # epd_images_per_prompt's default
    # Raw 16-px patches one image may produce (= vision_attention_block_size on the engines).
    max_image_patches: int = Field(default=1024, gt=0)
    oversized_image: Literal["downscale", "reject"] = "downscale"
    # The HTTP request body (checked by the router before parsing).
    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    # The body without its inline image data (text, structure, other URLs): what the JSON
    # parser and the tokenizer go through. 1 MiB is about the longest context Qwen3-VL takes.
    max_text_bytes: int = Field(default=1024 * 1024, gt=0)
    # ... its nesting depth, and its `, : [ {` bytes (an upper bound on its values, so
    # parsing stays a few milliseconds of CPU whatever the body holds).
    max_json_depth: int = Field(default=32, ge=4, le=256)
    max_json_values: int = Field(default=16384, ge=64)
    # Requests being preprocessed at once (counted from a complete body on); more get a 429.
    # Bodies still arriving are bounded per connection (listen.*), and their bytes in all by
    # this x max_body_bytes (503).
    max_requests_preprocessing: int = Field(default=64, ge=1)
    # Threads for chat-template rendering + tokenizing, and for image decoding, apart so a
    # burst of large images cannot delay text-only requests.
    text_workers: int = Field(default=2, ge=1, le=64)
    image_workers: int = Field(default=2, ge=1, le=64)
    # Per-image decode cost, checked before any pixel is decoded.
    max_image_bytes: int = Field(default=20 * 1024 * 1024, gt=0)
    max_image_pixels: int = Field(default=8192 * 8192, gt=0)  # decompression-bomb guard
    max_image_frames: int = Field(default=1000, ge=1)  # animations; only the first frame is used
    # Scans of a JPEG (counted from its markers): each scan of a progressive JPEG is decoded
    # over the whole image. Encoders write 1 (baseline) or about 10 (libjpeg's progression).
    max_jpeg_scans: int = Field(default=64, ge=1)
    # Wall time one image's decode and resize may take; an image above
    # image_decode_inline_pixels is decoded in a child process that is killed past it (400).
    # Smaller ones decode in the image thread: their cost is bounded by pixels x scans.
    image_decode_timeout_s: float = Field(default=5.0, gt=0)
    image_decode_inline_pixels: int = Field(default=2048 * 2048, ge=0)
    # Formats handed to a Pillow decoder; anything else is a 400 before any plugin parses it
    # (never EPS/PS: Pillow runs Ghostscript on them). Pillow's format names.
    image_formats: list[ImageFormat] = Field(
        default_factory=lambda: ["PNG", "JPEG", "WEBP", "GIF", "BMP"], min_length=1
    )
    # Image jobs (decode, resize, pixel values) one client may have running or queued at once;
    # 0 means half of image_workers (at least 1), so one client cannot hold every image thread.
    image_jobs_per_client: int = Field(default=0, ge=0, le=64)
    # Prepared-image LRU (by mm_hash); the byte bound is what limits memory (0 disables).
    image_cache_items: int = Field(default=256, ge=0)
    image_cache_bytes: int = Field(default=1024 * 1024 * 1024, ge=0)

    @property
    def image_jobs_per_client_effective(self) -> int:
        return self.image_jobs_per_client or max(1, self.image_workers // 2)


class Media(Section):
    """Where images may come from. data: URLs are always allowed; http(s) only if enabled
    and the host is listed: the router must not become a tool to reach internal hosts."""

    allow_http: bool = False
    # "host" (the scheme's default port only) or "host:port"; IPv6 as "[::1]" or "[::1]:8080";
    # exact names, no wildcards, compared lower-case.
    allowed_hosts: list[str] = Field(default_factory=list)
    fetch_timeout_s: float = Field(default=10.0, gt=0)
    max_redirects: int = Field(default=3, ge=0, le=10)

    @field_validator("allowed_hosts")
    @classmethod
    def _lower(cls, hosts: list[str]) -> list[str]:
        out = [h.strip().lower() for h in hosts]
        for entry in out:
            parse_host_entry(entry)  # refuse unusable entries at load time
        return out

    def allows(self, host: str, port: int, default_port: int) -> bool:
        """Whether `host:port` is on the allow-list (a host-only entry means its default port)."""
        host = host.lower()
        for entry in self.allowed_hosts:
            allowed_host, allowed_port = parse_host_entry(entry)
            if allowed_host == host and port == (allowed_port or default_port):
                return True
        return False


def parse_host_entry(entry: str) -> tuple[str, int | None]:
    """`host`, `host:port`, `[v6]` or `[v6]:port` -> (host, port or None)."""
    if entry.startswith("["):
        host, bracket, rest = entry[1:].partition("]")
        if not bracket or not host or (rest and not rest.startswith(":")):
            raise ValueError(f"allowed host {entry!r}: expected [ipv6] or [ipv6]:port")
        port_text = rest[1:]
    elif entry.count(":") > 1:
        raise ValueError(f"allowed host {entry!r}: write IPv6 addresses in brackets, e.g. [::1]:8080")
    else:
        host, _, port_text = entry.partition(":")
    if not host:
        raise ValueError(f"allowed host {entry!r}: no host name")
    if not port_text:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"allowed host {entry!r}: bad port")
    return host, int(port_text)
