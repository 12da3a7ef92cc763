"""What the router needs from preprocessing, as a protocol, plus incremental detokenization.

The production renderer is `epd_kit.preprocess.Preprocessor`; unit tests plug in a small
fake with the same shape, so the request orchestration is testable on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class PreparedItemLike(Protocol):
    mm_hash: str
    offset: int
    length: int
    ve_kwargs_b64: str
    pd_kwargs_b64: str


class RenderedPromptLike(Protocol):
    token_ids: list[int]
    items: Sequence[PreparedItemLike]


class Renderer(Protocol):
    async def render(self, messages: list[dict[str, Any]]) -> RenderedPromptLike: ...

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for a growing token list, never splitting a multi-byte character.

    The prefix/read-offset scheme of vLLM's incremental detokenizer, on top of any
    `detokenize(ids)`: decode a short window before and after the new tokens and emit the
    difference, holding text back while it ends in U+FFFD (an incomplete UTF-8 sequence)."""

    def __init__(self, renderer: Renderer, skip_special_tokens: bool = True) -> None:
        self._renderer = renderer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._renderer.detokenize(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: Sequence[int]) -> str:
        self.token_ids.extend(new_ids)
        if not new_ids:
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        full_text = self._decode(self.token_ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a choice: whatever is still held back (a truly invalid tail)."""
        if self._read >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        full_text = self._decode(self.token_ids[self._prefix :])
        delta = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
        self._prefix = self._read = len(self.token_ids)
        self.text += delta
        return delta
