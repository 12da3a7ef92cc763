"""Shared pieces of the router unit tests: configs, and a renderer stand-in whose tokens are
character codes (the real preprocessor is tested in tests/unit/preprocess)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from epd_kit.preprocess import PreparedItem, RenderedPrompt
from epd_kit.preprocess.text import TokenIdOutOfRange


def router_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """A router.yaml document: one VE, two PDs on unused 127.0.0.1 ports, `sections` merged."""
    data: dict[str, Any] = {
        "model": "/m",
        "endpoints": {
            "ve": [{"id": "epd-ve-0", "url": "http://127.0.0.1:1"}],
            "pd": [{"id": "epd-pd-0", "url": "http://127.0.0.1:2"}, {"id": "epd-pd-1", "url": "http://127.0.0.1:3"}],
        },
    }
    data.update(sections)
    return data


@pytest.fixture
def config() -> Callable[..., dict[str, Any]]:
    return router_config


def item(mm_hash: str, offset: int, length: int, ve: str = "K", pd: str = "P") -> PreparedItem:
    return PreparedItem(
        mm_hash=mm_hash,
        offset=offset,
        length=length,
        grid_thw=(1, 2, 2 * length),
        num_patches=4 * length,
        ve_kwargs=ve.encode(),
        pd_kwargs_b64=pd,
    )


@pytest.fixture
def make_item() -> Callable[..., PreparedItem]:
    return item


def chars(ids: Sequence[int]) -> str:
    """Token ids as characters; an id that is no character is outside this vocabulary, as
    the real codec says it (TextCodec.check_ids)."""
    for t in ids:
        if type(t) is not int or not 0 <= t < 0x110000:
            raise TokenIdOutOfRange(f"token id {t!r:.40} is outside the model's vocabulary [0, {0x110000})")
    return "".join(map(chr, ids))


class CharDetokenizer:
    def __init__(self) -> None:
        self.pushed: list[int] = []

    def push(self, new_ids: Sequence[int]) -> str:
        text = chars(new_ids)
        self.pushed += new_ids
        return text


class CharRenderer:
    """Renders every request to the same prompt; token id N is the character chr(N)."""

    def __init__(self, token_ids: list[int] | None = None, items: list[PreparedItem] | None = None) -> None:
        self.prompt = RenderedPrompt(token_ids=token_ids or [1, 2, 3], items=items or [])
        self.rendered = 0

    async def render(self, messages, *, add_generation_prompt=True, inline=None) -> RenderedPrompt:
        self.rendered += 1
        return self.prompt

    def detokenize(self, ids, skip_special_tokens=True) -> str:
        return chars(ids)

    def detokenizer(self, *, skip_special_tokens=True) -> CharDetokenizer:
        return CharDetokenizer()


@pytest.fixture
def char_renderer() -> Callable[..., CharRenderer]:
    return CharRenderer
