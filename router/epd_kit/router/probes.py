"""Serving probes: the tiny real requests the prober sends an engine that must prove it
serves again (health.py), a one-image encode for a VE and a one-token generate for a PD.
Built once at start through the router's own renderer, so they take the production path."""

from __future__ import annotations

import base64
import io
import logging
import uuid
from dataclasses import dataclass

from epd_kit.preprocess.errors import PreprocessError
from epd_kit.router import bodies
from epd_kit.router.rendering import PreparedItemLike, Renderer
from epd_kit.wire import EC_LOCATOR, HandoffKind

log = logging.getLogger("epd_router.probes")

_IMAGE_SIDE = 64  # resized up to the model's minimum anyway: the cheapest real encode


def _probe_image_url() -> str:
    from PIL import Image  # the renderer has imported it already

    buf = io.BytesIO()
    Image.new("RGB", (_IMAGE_SIDE, _IMAGE_SIDE), (128, 96, 64)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass(frozen=True)
class ServingProbes:
    prompt: list[int]  # a short rendered prompt, for a PD
    item: PreparedItemLike | None  # one small image, for a VE (None: the model has no vision)

    @classmethod
    async def build(cls, renderer: Renderer) -> ServingProbes:
        text = await renderer.render([{"role": "user", "content": "ping"}])
        image = [{"type": "image_url", "image_url": {"url": _probe_image_url()}}]
        item = None
        try:
            rendered = await renderer.render([{"role": "user", "content": image}])
            item = rendered.items[0] if rendered.items else None
        except (PreprocessError, ValueError) as exc:
            log.warning("no serving probe for VEs: /health alone readmits them", extra={"error": str(exc)})
        return cls(prompt=list(text.token_ids), item=item)

    @staticmethod
    def request_id() -> str:
        return f"probe-{uuid.uuid4().hex}"

    def pd_body(self, handoff: HandoffKind = EC_LOCATOR) -> dict:
        """A text-only PD body in the fleet's hand-off (an upstream PD gets no kv_transfer_params)."""
        sampling = {"max_tokens": 1, "output_kind": 2}
        return bodies.pd_request_body(self.request_id(), self.prompt, [], sampling, {}, False, handoff)
