"""Router-side preprocessing (contract §5): render once, on the router.

API (the router codes against this; see docs/preprocessing.md for the details)::

    pre = Preprocessor.from_checkpoint(path, model_id=None, limits=PreprocessLimits(...),
                                       media=MediaPolicy(...), workers=4, cache_items=256,
                                       cache_bytes=1 GiB, encoder=None)
    rendered = await pre.render(messages, add_generation_prompt=True)   # -> RenderedPrompt
        rendered.token_ids        prompt ids, <|image_pad|> expanded (N = t*h*w / merge^2 each)
        rendered.items            [PreparedItem] in prompt order, duplicates kept:
                                  mm_hash, offset, length, grid_thw, num_patches,
                                  ve_kwargs_b64 (pixel_values + image_grid_thw, for a VE),
                                  pd_kwargs_b64 (image_grid_thw only, for a PD)
        rendered.unique_items()   {mm_hash: first PreparedItem}: what to encode
        rendered.pd_features()    wire.Features for the PD request
    pre.detokenize(ids, skip_special_tokens=True) -> str
    pre.detokenizer(skip_special_tokens=True)     -> IncrementalDetokenizer (.push(ids) -> delta,
                                                     .flush() -> held-back tail)
    pre.eos_token_ids                             -> frozenset[int]
    pre.stats                                     -> PreprocessStats (cache hits/misses, ...)
    await pre.aclose()

Bad input raises a `PreprocessError` subclass with `.status` (400 or 413), `.message` and
`.param` (where in the request). A broken checkpoint raises `CheckpointError` at startup.
"""

from .encoder import ItemEncoder, MmSerdeEncoder
from .errors import (
    ImageDimensionsRejected,
    ImageOverBudget,
    ImageTooLarge,
    InvalidMessages,
    MalformedImageUrl,
    MediaFetchFailed,
    MediaFetchRefused,
    ModelHasNoVision,
    NotAnImage,
    PreprocessError,
    PromptMismatch,
    TooManyImages,
    UnsupportedContent,
    VideoNotSupported,
)
from .model_files import CheckpointError, CheckpointFiles, VisionSettings
from .preprocessor import (
    PreparedImage,
    PreparedItem,
    Preprocessor,
    PreprocessStats,
    RenderedPrompt,
)
from .settings import MediaPolicy, PreprocessLimits
from .text import IncrementalDetokenizer

__all__ = [
    "CheckpointError",
    "CheckpointFiles",
    "ImageDimensionsRejected",
    "ImageOverBudget",
    "ImageTooLarge",
    "IncrementalDetokenizer",
    "InvalidMessages",
    "ItemEncoder",
    "MalformedImageUrl",
    "MediaFetchFailed",
    "MediaFetchRefused",
    "MediaPolicy",
    "MmSerdeEncoder",
    "ModelHasNoVision",
    "NotAnImage",
    "PreparedImage",
    "PreparedItem",
    "PreprocessError",
    "PreprocessLimits",
    "PreprocessStats",
    "Preprocessor",
    "PromptMismatch",
    "RenderedPrompt",
    "TooManyImages",
    "UnsupportedContent",
    "VideoNotSupported",
    "VisionSettings",
]
