"""Router-side preprocessing (docs/contract.md §5): render once, on the router.

API (the router codes against this; see docs/preprocessing.md for the details)::

    pre = Preprocessor.from_checkpoint(path, model_id=None, limits=Limits(...),
                                       media=Media(...), workers=None, encoder=None)
    rendered = await pre.render(messages, add_generation_prompt=True)   # -> RenderedPrompt
        rendered.token_ids        prompt ids, <|image_pad|> expanded (N = t*h*w / merge^2 each)
        rendered.items            [PreparedItem] in prompt order, duplicates kept:
                                  mm_hash, offset, length, grid_thw, num_patches,
                                  ve_kwargs (pixel_values + image_grid_thw, for a VE,
                                  base64 ASCII bytes; ve_kwargs_b64 the same as text),
                                  pd_kwargs_b64 (image_grid_thw only, for a PD)
        rendered.unique_items()   {mm_hash: first PreparedItem}: what to encode
        rendered.pd_features()    wire.Features for the PD request
    pre.detokenize(ids, skip_special_tokens=True) -> str
    pre.detokenizer(skip_special_tokens=True)     -> IncrementalDetokenizer (.push(ids) -> delta;
                                                     an open UTF-8 tail is never emitted)
    pre.eos_token_ids                             -> frozenset[int]
    pre.stats                                     -> PreprocessStats (cache hits/misses, ...)
    await pre.aclose()

`Limits` and `Media` are the router.yaml sections of the same names (settings.py); the
prepared-image cache bounds are `limits.image_cache_items` / `limits.image_cache_bytes`, the
two thread pools `limits.text_workers` / `limits.image_workers` (`workers` sets both).

Bad input raises a `PreprocessError` subclass with `.status` (400 or 413), `.message` and
`.param` (where in the request). A broken checkpoint raises `CheckpointError` at startup.

Names are imported on first use: the router's config loads `settings` alone, without the
tokenizer, numpy and Pillow behind the preprocessor (`epd-router check-config` stays fast
and the server installs its signal handlers before the heavy imports).
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_EXPORTS = {
    "ItemEncoder": "encoder",
    "MmSerdeEncoder": "encoder",
    "ImageDecodeTooSlow": "errors",
    "ImageDimensionsRejected": "errors",
    "ImageOverBudget": "errors",
    "ImageTooLarge": "errors",
    "InvalidMessages": "errors",
    "MalformedImageUrl": "errors",
    "MediaFetchFailed": "errors",
    "MediaFetchRefused": "errors",
    "ModelHasNoVision": "errors",
    "NotAnImage": "errors",
    "PreprocessError": "errors",
    "PromptMismatch": "errors",
    "TooManyImages": "errors",
    "UnsupportedContent": "errors",
    "VideoNotSupported": "errors",
    "CheckpointError": "model_files",
    "CheckpointFiles": "model_files",
    "VisionSettings": "model_files",
    "PreparedImage": "preprocessor",
    "PreparedItem": "preprocessor",
    "Preprocessor": "preprocessor",
    "PreprocessStats": "preprocessor",
    "RenderedPrompt": "preprocessor",
    "Limits": "settings",
    "Media": "settings",
    "IncrementalDetokenizer": "text",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
