"""What the router needs from preprocessing, as a protocol, and the one call it makes.

The production renderer is `epd_kit.preprocess.Preprocessor`; unit tests plug in a small
fake with the same shape, so the request orchestration is testable on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from epd_kit.preprocess.errors import PreprocessError
from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import ChatCompletionRequest, Message


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
    """Incremental detokenizer of one choice: `push(ids) -> delta` (a tail that never completes
    is never emitted, as in vLLM's text: preprocess/text.py IncrementalDetokenizer)."""

    def push(self, new_ids: Sequence[int]) -> str: ...


class Renderer(Protocol):
    async def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        inline: Mapping[str, bytes | memoryview] | None = None,
    ) -> RenderedPromptLike:
        """`inline`: image payloads kept apart from `messages`, by URL (router/body.py)."""

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def detokenizer(self, *, skip_special_tokens: bool = True) -> DetokenizerLike: ...


async def render_request(
    renderer: Renderer, request: ChatCompletionRequest, inline: Mapping[str, bytes | memoryview] | None = None
) -> RenderedPromptLike:
    """The request's prompt; bad input becomes a 400/413 naming where it is in the request."""
    messages = [_as_dict(m) for m in request.messages]
    try:
        return await renderer.render(messages, add_generation_prompt=request.add_generation_prompt, inline=inline)
    except RouterError:
        raise
    except PreprocessError as exc:
        param = exc.param or "messages"
        raise RouterError(exc.status, f"{param}: {exc.message}", param=param) from None
    except ValueError as exc:
        raise RouterError(400, f"cannot render the prompt: {exc}", param="messages") from None


def _as_dict(message: Message) -> dict[str, Any]:
    """`message.model_dump(exclude_none=True)`, without the dump for the common text message."""
    if isinstance(message.content, str) and not message.__pydantic_extra__:
        return {"role": message.role, "content": message.content}
    return message.model_dump(exclude_none=True)
