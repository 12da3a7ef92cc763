"""Image decode, Qwen-VL resize rules and pixel_values, in numpy (no torch, no torchvision).

The arithmetic follows transformers' Qwen2-VL image processor (PIL backend), which Qwen3-VL
uses with patch 16 / merge 2: PIL bicubic resize of the uint8 RGB image to the smart_resize
size, x * rescale_factor in float64 cast to float32, (x - mean) / std in float32, then the
patch layout (h/m, w/m, m, m, C, T, p, p) with the frame repeated T = temporal_patch_size
times, cast to the engine's dtype (vision.pixel_dtype) as vLLM's processor casts them. The
per-value arithmetic and the cast are done once per channel and byte value (a 256-entry
lookup table), which gives the same values as the elementwise path, only faster.

A photo's EXIF orientation is applied on decode (as vLLM's media loader does), so the
encoder sees it upright.

Only formats on `limits.image_formats` reach a Pillow plugin (`Image.open(formats=...)`):
Pillow's EPS plugin, for one, hands client bytes to Ghostscript wherever that is installed.
Frame counts come from the container without decoding a frame: Pillow counts a GIF's
frames by seeking through them, and each seek decodes the frame before it (a 999-frame
4096x4096 GIF held an image thread for minutes), so GIF blocks are walked here instead.
A JPEG's scans are counted the same way, from its markers: a progressive JPEG decodes every
scan over the whole image (an 8192x8192 one whose last 99-byte refinement scan was repeated
cost ~40-50 ms per copy), so `limits.max_jpeg_scans` refuses one with too many before any
is decoded. What is left (pixels x scans) is bounded by decoding.py's budget.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import threading
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, ImageOps

from .. import mm_serde
from .cancel import WorkCancelled, stop_if
from .errors import ImageDimensionsRejected, ImageOverBudget, ImageTooLarge, NotAnImage
from .model_files import VisionSettings
from .settings import Limits

MAX_ASPECT_RATIO = 200  # smart_resize refuses anything more extreme
_WHITE = (255, 255, 255)


def check_encoded_size(num_bytes: int, limits: Limits) -> None:
    if num_bytes > limits.max_image_bytes:
        raise ImageTooLarge(
            f"image is {num_bytes} bytes, above the limit of {limits.max_image_bytes} bytes "
            "(limits.max_image_bytes); send a smaller or more compressed image"
        )


def open_image(data: bytes, limits: Limits) -> Image.Image:
    """The image's header parsed by a plugin on the allow-list (nothing decoded yet)."""
    # (No warnings filter here: it is process-global and this runs in worker threads.)
    return Image.open(io.BytesIO(data), formats=limits.image_formats)


def decode_image(data: bytes, limits: Limits, cancelled: threading.Event | None = None) -> Image.Image:
    """Encoded bytes -> upright RGB PIL image (first frame of animations). The decode cost
    is bounded before any pixel is decoded: bytes, pixels and frames (limits.max_image_*).
    `cancelled`: set when nobody waits for the image any more (checked before decoding)."""
    check_encoded_size(len(data), limits)
    try:
        # open() reads only the header: check the pixel count before decoding anything.
        image = open_image(data, limits)
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise ImageDimensionsRejected(
                f"image is {width}x{height} = {width * height} pixels, above the decode "
                f"limit of {limits.max_image_pixels} pixels (limits.max_image_pixels)"
            )
        _check_frames(image, data, limits.max_image_frames)
        if image.format in ("JPEG", "MPO"):  # Pillow names a JPEG with an MP index MPO
            _check_scans(data, limits.max_jpeg_scans)
        stop_if(cancelled)
        image.load()
    except (ImageDimensionsRejected, WorkCancelled):
        raise
    except Image.DecompressionBombError as exc:
        raise ImageDimensionsRejected(f"image refused as a decompression bomb: {exc}") from exc
    except Exception as exc:  # Pillow raises many types for corrupt or unknown data
        raise NotAnImage(
            f"the data is not a decodable image ({exc}); "
            f"send one of the formats this router takes ({', '.join(limits.image_formats)}; limits.image_formats)"
        ) from exc
    if width == 0 or height == 0:
        raise NotAnImage(f"image has an empty dimension ({width}x{height})")
    return to_rgb(upright(image))


def upright(image: Image.Image) -> Image.Image:
    """The image as displayed: its EXIF orientation applied. A broken EXIF block leaves the
    image as stored, as vLLM's `normalize_image` does."""
    with contextlib.suppress(Exception):
        # an upright photo (the common case) is returned as is, not copied
        return ImageOps.exif_transpose(image, in_place=False) if _orientation(image) != 1 else image
    return image


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation tag (1 = upright, also when absent)."""
    return int(image.getexif().get(ExifTags.Base.Orientation, 1))


@dataclass(frozen=True)
class Decoded:
    """An image decoded and resized to its plan: what pixel_values are made of (small: at
    most limits.max_image_patches patches, so it crosses a process boundary cheaply)."""

    source_size: tuple[int, int]  # (width, height) as sent
    plan: ResizePlan
    resized: Image.Image  # RGB, plan.width x plan.height


def decode_resized(
    data: bytes, limits: Limits, vision: VisionSettings, cancelled: threading.Event | None = None
) -> Decoded:
    """decode_image, the resize plan and the resize: the stages whose cost grows with the
    image as sent (decoding.py runs a large image's in a process it can kill)."""
    rgb = decode_image(data, limits, cancelled)
    width, height = rgb.size
    plan = plan_resize(height, width, vision, limits)
    stop_if(cancelled)
    return Decoded(source_size=(width, height), plan=plan, resized=resize(rgb, plan))


def resize(image: Image.Image, plan: ResizePlan) -> Image.Image:
    if image.size == (plan.width, plan.height):
        return image
    return image.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC)


def _check_frames(image: Image.Image, data: bytes, limit: int) -> None:
    """Refuse an animation with more than `limit` frames, without decoding any: a GIF by
    walking its blocks (`gif_frames`), the other allowed formats by the count their header
    declares (PNG's acTL, WebP's ANIM info, MPO's index: Pillow reads them on open)."""
    gif = image.format == "GIF"
    frames = gif_frames(data, limit + 1) if gif else int(getattr(image, "n_frames", 1) or 1)
    if frames > limit:
        raise ImageDimensionsRejected(
            f"animated image has more than {limit} frames (limits.max_image_frames); "
            "only the first frame is used, send it as a still image"
        )


def _check_scans(data: bytes, limit: int) -> None:
    if jpeg_scans(data, limit + 1) > limit:
        raise ImageDimensionsRejected(
            f"JPEG has more than {limit} scans (limits.max_jpeg_scans); every scan of a "
            "progressive JPEG is decoded over the whole image: re-encode it (baseline, or the "
            "encoder's standard progression of about 10 scans)"
        )


# A marker inside entropy-coded data: 0xFF followed by neither a stuffed 0x00, nor a fill
# byte 0xFF, nor a restart marker RST0-7 (ITU T.81 B.1.1.5, F.1.2.3)
_MARKER_IN_SCAN = re.compile(rb"\xff[^\x00\xff\xd0-\xd7]")


def jpeg_scans(data: bytes, stop_at: int) -> int:
    """Start-of-scan (SOS, 0xFFDA) markers of a JPEG's first image, counted up to
    `stop_at` by its marker structure (ITU T.81 B.1): SOI, then segments with a 2-byte
    length, each SOS followed by entropy-coded data up to the next marker, EOI at the end.
    Bytes between segments that are no marker are skipped to the next one, as libjpeg's
    `next_marker` does; a truncated segment ends the count."""
    size = len(data)
    pos = 2  # after SOI
    scans = 0
    while pos + 1 < size and scans < stop_at:
        if data[pos] != 0xFF or data[pos + 1] in (0x00, 0xFF):
            found = _MARKER_IN_SCAN.search(data, pos + 1)
            if found is None:
                break
            pos = found.start()
            continue
        marker = data[pos + 1]
        if marker == 0xD9:  # EOI
            break
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # standalone: RSTn, TEM
            pos += 2
            continue
        if pos + 3 >= size:
            break
        pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])
        if marker == 0xDA:  # the scan's header; its entropy-coded data runs to the next marker
            scans += 1
            found = _MARKER_IN_SCAN.search(data, pos)
            if found is None:
                break
            pos = found.start()
    return scans


def gif_frames(data: bytes | memoryview, stop_at: int) -> int:
    """Image descriptors in a GIF stream, counted up to `stop_at`, by its block structure
    (GIF89a spec: header, logical screen descriptor, optional global colour table, then
    extension (0x21), image (0x2C) and trailer (0x3B) blocks, each image's data in
    length-prefixed sub-blocks). A truncated or unknown block ends the count."""
    view = memoryview(data)
    size = len(view)
    if size < 13:
        return 0
    pos = 13 + (3 << ((view[10] & 7) + 1) if view[10] & 0x80 else 0)
    frames = 0
    while pos < size and frames < stop_at:
        kind = view[pos]
        if kind == 0x2C:  # image descriptor (10 bytes), local colour table, LZW code size
            if pos + 10 > size:
                break
            packed = view[pos + 9]
            pos += 10 + (3 << ((packed & 7) + 1) if packed & 0x80 else 0) + 1
            frames += 1
        elif kind == 0x21:  # extension: introducer and label
            pos += 2
        else:  # 0x3B trailer, or not a block
            break
        while pos < size:  # the data sub-blocks, ended by a zero length
            length = view[pos]
            pos += 1 + length
            if length == 0:
                break
    return frames


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited on white (what vLLM's media loader does for RGBA)."""
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    out = Image.new("RGB", rgba.size, _WHITE)
    out.paste(rgba, mask=rgba.getchannel("A"))
    return out


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL target size: both sides multiples of `factor`, area in [min, max], aspect kept."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageDimensionsRejected(f"image aspect ratio {width}x{height} is more extreme than {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ResizePlan:
    height: int
    width: int
    grid_thw: tuple[int, int, int]
    downscaled_for_budget: bool

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


def plan_resize(height: int, width: int, vision: VisionSettings, limits: Limits) -> ResizePlan:
    """Target size under the checkpoint's rules, then under the patch budget (downscale or 400)."""
    factor, patch = vision.factor, vision.patch_size
    h, w = smart_resize(height, width, factor=factor, min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)
    patches = (h // patch) * (w // patch)
    budget = limits.max_image_patches
    downscaled = False
    if patches > budget:
        if limits.oversized_image == "reject":
            raise ImageOverBudget(
                f"image {width}x{height} resizes to {w}x{h} = {patches} patches of "
                f"{patch}px, above the budget of {budget} (limits.max_image_patches); "
                f"downscale it to at most about {_fitting_edge(width, height, budget * patch * patch)} "
                "or ask the operator to set limits.oversized_image: downscale"
            )
        # The same rule with max_pixels = budget area; smart_resize floors to the factor, so
        # it fits except at extreme aspect ratios, where the short side is pinned at one factor.
        max_pixels = min(budget * patch * patch, vision.max_pixels)
        for _ in range(32):
            h, w = smart_resize(
                height, width, factor=factor, min_pixels=min(vision.min_pixels, max_pixels), max_pixels=max_pixels
            )
            patches = (h // patch) * (w // patch)
            if patches <= budget:
                break
            max_pixels = int(max_pixels * 0.9)
        else:
            raise ImageOverBudget(
                f"image {width}x{height} cannot be downscaled to {budget} patches "
                "(limits.max_image_patches) at its aspect ratio"
            )
        downscaled = True
    grid = (1, h // patch, w // patch)
    return ResizePlan(height=h, width=w, grid_thw=grid, downscaled_for_budget=downscaled)


def _fitting_edge(width: int, height: int, area: int) -> str:
    scale = math.sqrt(area / (width * height))
    return f"{max(1, int(width * scale))}x{max(1, int(height * scale))} pixels"


def _value_table(vision: VisionSettings) -> np.ndarray:
    """(3, 256): the processor's value for each channel and byte, same op order, in float32
    and then cast to the pixel dtype (bfloat16 as raw words, mm_serde.BFLOAT16)."""
    values = np.arange(256, dtype=np.float64) * vision.rescale_factor
    values = values.astype(np.float32)
    if not vision.do_normalize:
        table = np.stack([values] * 3)
    else:
        mean = np.asarray(vision.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(vision.image_std, dtype=np.float32)[:, None]
        table = ((values[None, :] - mean) / std).astype(np.float32)
    if vision.pixel_dtype == "bfloat16":
        return mm_serde.to_bfloat16(table)
    return table.astype(vision.pixel_dtype)


class PixelEncoder:
    """RGB image + plan -> pixel_values (t*h*w, 3*T*p*p) in vision.pixel_dtype, Qwen2-VL
    patch order."""

    def __init__(self, vision: VisionSettings) -> None:
        self._vision = vision
        self._table = _value_table(vision)
        self._scratch = threading.local()  # per worker thread: buffers reused image after image
        # numpy moves structured dtypes (BFLOAT16) element by element: gather and lay out
        # the same bytes as plain integers of the same width instead (several times faster)
        self._plain = np.dtype(f"<u{self._table.dtype.itemsize}") if self._table.dtype.names else self._table.dtype

    def resize(self, image: Image.Image, plan: ResizePlan) -> Image.Image:
        return resize(image, plan)

    def _buffers(self, height: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This thread's (channel planes, looked-up values, values in patch order), flat, for
        a height x width image: views of buffers kept across images (fresh memory costs a
        page fault per 4 KiB written), grown to fit (a resized image is bounded by
        limits.max_image_patches)."""
        n = 3 * height * width
        s = self._scratch
        if getattr(s, "planes", None) is None or s.planes.size < n:
            s.planes, s.values, s.patches = np.empty(n, np.uint8), np.empty(n, self._plain), np.empty(n, self._plain)
        return s.planes[:n], s.values[:n], s.patches[:n]

    @property
    def dtype(self) -> np.dtype:
        """The dtype pixel_values are written in (mm_serde.BFLOAT16 words for bfloat16)."""
        return self._table.dtype

    def shape(self, plan: ResizePlan) -> tuple[int, int]:
        """(patches, values per patch) of the pixel_values of an image resized to `plan`."""
        return plan.num_patches, self._vision.patch_dim

    def pixel_values(self, resized: Image.Image, out: np.ndarray | None = None) -> np.ndarray:
        """`out`: where to write them (shape `shape(plan)`, dtype `dtype`), e.g. a view into
        the buffer that is serialized next; a new array without it."""
        v = self._vision
        p, m, t = v.patch_size, v.merge_size, v.temporal_patch_size
        hwc = np.asarray(resized, dtype=np.uint8)
        height, width, _ = hwc.shape
        gh, gw = height // p, width // p
        table = self._table.view(self._plain)
        planes, values, patches = self._buffers(height, width)
        planes, chw = planes.reshape(3, height, width), values.reshape(3, height, width)
        np.copyto(planes, hwc.transpose(2, 0, 1))  # numpy's take is ~3x slower on strided indices
        for c in range(3):  # byte -> normalized float, one table lookup per pixel (a byte is < 256: "clip" never clips)
            np.take(table[c], planes[c], out=chw[c], mode="clip")
        # (C, gh/m, m, p, gw/m, m, p) -> (gh/m, gw/m, m, m, C, p, p)
        blocks = chw.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        if out is None:
            out = np.empty((gh * gw, v.patch_dim), dtype=self._table.dtype)
        # one frame in patch order, then the frame repeated t times into `out` (through views:
        # it is C-contiguous); two copies, the second of runs of p*p values, beat one 8-D one
        patches.reshape(gh // m, gw // m, m, m, 3, p, p)[...] = blocks
        out.view(self._plain).reshape(gh * gw, 3, t, p * p)[...] = patches.reshape(gh * gw, 3, 1, p * p)
        return out
