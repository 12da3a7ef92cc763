"""Errors for bad input found while preprocessing a request.

Every error carries the HTTP status the router answers with (400, or 413 for sizes), a
message that says what was wrong, and, where known, `param`: which part of the request
(e.g. ``messages[1].content[2]``). Nothing here is an internal error: a bug must surface as
a different exception type.
"""

from __future__ import annotations


class PreprocessError(Exception):
    status: int = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return f"{self.param}: {self.message}" if self.param else self.message


class InvalidMessages(PreprocessError):
    """Messages that are not valid OpenAI chat messages (roles, parts, shapes)."""


class UnsupportedContent(PreprocessError):
    """A content part type we do not handle (audio, files, ...)."""


class VideoNotSupported(UnsupportedContent):
    """Video parts: the EPD wire has no per-frame placeholders (docs/contract.md §5.4)."""


class TooManyImages(PreprocessError):
    """More images than `limits.images_per_prompt`."""


class MalformedImageUrl(PreprocessError):
    """A data: URL that does not parse, or a URL with an unusable scheme."""


class MediaFetchRefused(PreprocessError):
    """An http(s) image URL the media policy does not allow (SSRF guard)."""


class MediaFetchFailed(PreprocessError):
    """An allowed http(s) image URL that could not be fetched (status, timeout, redirect)."""


class NotAnImage(PreprocessError):
    """Bytes Pillow cannot decode as an image."""


class ImageTooLarge(PreprocessError):
    """Encoded image bigger than `limits.max_image_bytes`."""

    status = 413


class ImageDimensionsRejected(PreprocessError):
    """Decoded dimensions we refuse: decompression-bomb guard, extreme aspect ratio."""


class ImageDecodeTooSlow(PreprocessError):
    """An image whose decode did not end within `limits.image_decode_timeout_s` (its work
    was stopped: decoding.py)."""


class ImageOverBudget(PreprocessError):
    """An image above `limits.max_image_patches` while `oversized_image: reject`."""


class PromptMismatch(PreprocessError):
    """The rendered prompt's image placeholders do not line up with the images given
    (e.g. the text itself contains ``<|image_pad|>``)."""


class SpecialTokenInText(PromptMismatch):
    """Message text that holds one of the tokenizer's special tokens (`<|video_pad|>`,
    `<|vision_start|>`, `<|im_end|>`, ...): tokenized from text they would be those tokens, the
    placeholders and markers only the chat template may write (text.py `special_token_in`)."""


class ModelHasNoVision(PreprocessError):
    """Images sent to a text-only checkpoint."""
