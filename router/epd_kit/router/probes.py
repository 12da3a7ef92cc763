"""Serving probes: the tiny real requests the prober sends an engine that must prove it
serves again (health.py), a one-image encode for a VE and a one-token generate for a PD.
Built through the router's own renderer, so they take the production path: the PD's prompt at
start, the VE's image with the first serving probe a VE needs (rendering an image imports numpy
and Pillow, ~0.2 CPU-s, which a start would pay every time for a probe most routers never send)."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import uuid

from epd_kit.preprocess.errors import PreprocessError
from epd_kit.router import bodies
from epd_kit.router.rendering import PreparedItemLike, Renderer
from epd_kit.wire import EC_LOCATOR, HandoffKind

log = logging.getLogger("epd_router.probes")

_IMAGE_SIDE = 64  # resized up to the model's minimum anyway: the cheapest real encode


def _probe_image_url() -> str:
    from PIL import Image  # the renderer imports it for the image anyway

    buf = io.BytesIO()
    Image.new("RGB", (_IMAGE_SIDE, _IMAGE_SIDE), (128, 96, 64)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class ServingProbes:
    def __init__(self, renderer: Renderer, prompt: list[int]) -> None:
        self.prompt = prompt  # a short rendered prompt, for a PD
        self._renderer = renderer
        self._item: PreparedItemLike | None = None
        self._item_tried = False
        self._item_lock = asyncio.Lock()

    @classmethod
    async def build(cls, renderer: Renderer) -> ServingProbes:
        text = await renderer.render([{"role": "user", "content": "ping"}])
        return cls(renderer, list(text.token_ids))

    async def image_item(self) -> PreparedItemLike | None:
        """One small image, for a VE (None: the model has no vision), rendered the first time
        it is asked for; one render, whatever its outcome."""
        async with self._item_lock:
            if not self._item_tried:
                self._item = await self._render_item()
                self._item_tried = True
        return self._item

    async def _render_item(self) -> PreparedItemLike | None:
        image = [{"type": "image_url", "image_url": {"url": _probe_image_url()}}]
        try:
            rendered = await self._renderer.render([{"role": "user", "content": image}])
        except (PreprocessError, ValueError) as exc:
            log.warning("no serving probe for VEs: /health alone readmits them", extra={"error": str(exc)})
            return None
        return rendered.items[0] if rendered.items else None

    @staticmethod
    def request_id() -> str:
        return f"probe-{uuid.uuid4().hex}"

    def pd_body(self, handoff: HandoffKind = EC_LOCATOR) -> dict:
        """A text-only PD body in the fleet's hand-off (an upstream PD gets no kv_transfer_params)."""
        sampling = {"max_tokens": 1, "output_kind": 2}
        return bodies.pd_request_body(self.request_id(), self.prompt, [], sampling, {}, False, handoff)
