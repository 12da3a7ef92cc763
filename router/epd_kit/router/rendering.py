"""What the router needs from preprocessing, as a protocol.

The production renderer is `epd_kit.preprocess.Preprocessor`; unit tests plug in a small
fake with the same shape, so the request orchestration is testable on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class PreparedItemLike(Protocol):
    mm_hash: str
    offset: int
    length: int
    ve_kwargs_b64: str
    pd_kwargs_b64: str


class RenderedPromptLike(Protocol):
    token_ids: list[int]
    items: Sequence[PreparedItemLike]


class DetokenizerLike(Protocol):
    """Incremental detokenizer of one choice: `push(ids) -> delta`, `flush() -> tail`."""

    def push(self, new_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class Renderer(Protocol):
    async def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> RenderedPromptLike: ...

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def detokenizer(self, *, skip_special_tokens: bool = True) -> DetokenizerLike: ...
