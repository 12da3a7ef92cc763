"""OpenAI chat messages, validated, and turned into what the chat template and the image
pipeline need: template messages (images as {"type": "image"}) plus the image URLs in
prompt order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import InvalidMessages, UnsupportedContent, VideoNotSupported

ROLES = ("system", "developer", "user", "assistant", "tool")
_VIDEO_PARTS = ("video_url", "video")
_OTHER_KNOWN_PARTS = ("input_audio", "audio_url", "file", "image_embeds", "image_pil", "refusal")


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ImageRef:
    url: str
    param: str  # where it sits in the request, for error messages


@dataclass(frozen=True)
class ParsedMessages:
    template_messages: list[dict[str, Any]]
    images: list[ImageRef]


def parse_messages(messages: Any) -> ParsedMessages:
    if not isinstance(messages, list) or not messages:
        raise InvalidMessages("'messages' must be a non-empty list of chat messages", param="messages")
    out: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise InvalidMessages("each message must be an object with 'role' and 'content'", param=where)
        role, text = raw.get("role"), raw.get("content")
        if type(role) is str and type(text) is str and len(raw) == 2:  # plain text: nothing to validate
            if role not in ROLES:
                raise InvalidMessages(f"role {role!r} is not one of {', '.join(ROLES)}", param=f"{where}.role")
            out.append({"role": role, "content": text})
            continue
        try:
            msg = _Message.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise InvalidMessages(f"{loc}: {first['msg']}", param=where) from None
        if msg.role not in ROLES:
            raise InvalidMessages(f"role {msg.role!r} is not one of {', '.join(ROLES)}", param=f"{where}.role")
        extra = {k: v for k, v in raw.items() if k not in ("role", "content")}
        if msg.content is None:
            if msg.role != "assistant":
                raise InvalidMessages(f"a {msg.role} message needs content", param=f"{where}.content")
            content: str | list[dict[str, Any]] = ""
        elif isinstance(msg.content, str):
            content = msg.content
        else:
            content = [_part(part, f"{where}.content[{j}]", images) for j, part in enumerate(msg.content)]
        out.append({**extra, "role": msg.role, "content": content})
    return ParsedMessages(template_messages=out, images=images)


def _part(part: dict[str, Any], where: str, images: list[ImageRef]) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidMessages("a text part needs a string 'text'", param=where)
        return {"type": "text", "text": text}
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str) or not url:
            raise InvalidMessages("an image_url part needs 'image_url': {'url': '...'}", param=where)
        images.append(ImageRef(url=url, param=where))
        return {"type": "image"}
    if kind in _VIDEO_PARTS:
        raise VideoNotSupported(
            "video input is not supported by this router (the EPD wire has no per-frame "
            "placeholders); send frames as separate images",
            param=where,
        )
    if kind in _OTHER_KNOWN_PARTS:
        raise UnsupportedContent(f"content part type {kind!r} is not supported; use 'text' or 'image_url'", param=where)
    raise UnsupportedContent(f"unknown content part type {kind!r}; use 'text' or 'image_url'", param=where)
