"""A chat request body -> its JSON document, with bounds that keep decoding cheap whatever a
client sends. routes.py runs it in a worker thread for big bodies, and no step here holds the
GIL for long, so the event loop keeps answering meanwhile.

- Inline images (the `data:...;base64,` strings that make most of a big body) are lifted
  out before the JSON parser sees the body, also when their base64 carries JSON escapes
  (`\\/` as PHP writes it, `\\n` in a line-wrapped one: that payload is unescaped, one
  copy). An image URL keeps a short marker in its place
  and its payload travels beside the document as a view of the body's bytes (`inline`), to
  be base64-decoded by the preprocessor straight from there: a 20 MB image is never copied
  into a Python string. Any other string that held such a payload gets it back verbatim.
- The JSON left is bounded by `limits.max_text_bytes` (its text goes through the tokenizer),
  counted in characters with a JSON escape as one (and at most 6x that in bytes),
  and `limits.max_json_values`, counted as its `, : [ {` bytes outside strings (an upper
  bound on its values; punctuation inside text is text, a prompt full of commas or a JSON
  document pasted into a prompt counts as one value) -> 413, and by `limits.max_json_depth` -> 400.
- Text must be valid Unicode: a lone UTF-16 surrogate (JSON allows `"\\ud800"`) cannot reach
  the tokenizer, the engines or the answer, so it is a 400 naming where it is, before any work.
- `NaN` and `Infinity` are not JSON (Python's parser accepts them): 400. Neither is a number
  too large for a double (`1e400`, which Python reads as infinity and would forward to the
  engines as `Infinity`): 400 naming the field.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from epd_kit.preprocess.settings import Limits
from epd_kit.router.errors import RouterError

_INLINE_MARK = b";base64,"
LIFT_MIN_BYTES = 4096  # only strings this long are lifted out of the JSON
_PIECE = 1 << 20  # the most bytes one C-level step scans or copies here
_SURROGATE = re.compile("[\ud800-\udfff]")
# a JSON string, possessive (no backtracking whatever the body holds)
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)


@dataclass
class DecodedBody:
    doc: Any
    # image URL as it stands in `doc` -> its base64 payload (a view of the request body)
    inline: dict[str, memoryview | bytes] = field(default_factory=dict)


def decode_body(body: bytes | bytearray, limits: Limits) -> DecodedBody:
    # the marker's nonce only matters when there is something to lift (most text bodies have not)
    nonce = os.urandom(8).hex() if _INLINE_MARK in body else ""
    skeleton, lifted = _lift_inline_data(body, nonce) if nonce else (body, [])
    if len(skeleton) > limits.max_text_bytes:
        _check_text_size(skeleton, limits.max_text_bytes)
    if _count_values(skeleton, limits.max_json_values) > limits.max_json_values:
        raise RouterError(
            413,
            f"request JSON has more than {limits.max_json_values} values (limits.max_json_values; "
            "counted as its , : [ { characters outside strings)",
        )
    overflowed: list[str] = []
    try:
        doc = json.loads(skeleton, parse_constant=_refuse_constant, parse_float=_float_noting(overflowed))
    except RecursionError:
        raise _too_deep(limits.max_json_depth, ()) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RouterError(400, f"request body is not valid JSON: {exc}") from None
    if overflowed:
        raise _not_finite(doc, overflowed[0])
    decoded = DecodedBody(doc)
    if lifted or not _nothing_to_walk_for(skeleton, limits.max_json_depth):
        _Walk(decoded, lifted, "\0" + nonce, limits.max_json_depth).run()
    return decoded


def _nothing_to_walk_for(skeleton: bytes | bytearray, max_depth: int) -> bool:
    """True when the walk could find nothing (most text requests; it costs more than the
    parse): pure ASCII without `\\u` escapes holds no surrogate, and a document cannot nest
    deeper than it has `[` and `{`."""
    return skeleton.isascii() and b"\\u" not in skeleton and skeleton.count(b"[") + skeleton.count(b"{") <= max_depth


def _lift_inline_data(body: bytes | bytearray, nonce: str) -> tuple[bytes | bytearray, list[memoryview | bytes]]:
    """The body with every long base64 payload replaced by a marker (a JSON escape no client
    can guess), and the payloads. A payload runs from `;base64,` to the end of its JSON
    string; one with escapes in it is unescaped (bytes), any other stays a view of the body."""
    view = memoryview(body)
    parts: list[bytes | memoryview] = []
    lifted: list[memoryview | bytes] = []
    pos = search = 0
    while (at := body.find(_INLINE_MARK, search)) >= 0:
        start = at + len(_INLINE_MARK)
        end, escaped = _string_end(body, start)
        if end < 0:
            break
        search = end + 1
        if end - start < LIFT_MIN_BYTES:
            continue
        payload: memoryview | bytes = view[start:end]
        if escaped:
            try:  # the JSON string's own rules (\/, \n, \uXXXX): what the parser would make of it
                payload = json.loads(b'"' + bytes(payload) + b'"').encode("utf-8", "surrogatepass")
            except ValueError:
                continue  # left in place: the parser reports it
        parts += [view[pos:start], f"\\u0000{nonce}{len(lifted)}".encode()]
        lifted.append(payload)
        pos = end
    if not lifted:
        return body, []
    parts.append(view[pos:])
    return b"".join(parts), lifted


def _string_end(body: bytes | bytearray, start: int) -> tuple[int, bool]:
    """The `"` that ends the JSON string `start` is in (-1 if none) and whether a backslash
    comes before it, a piece at a time."""
    for offset in range(start, len(body), _PIECE):
        stop = min(offset + _PIECE, len(body))
        quote = body.find(b'"', offset, stop)
        backslash = body.find(b"\\", offset, quote if quote >= 0 else stop)
        if backslash >= 0:
            return _escaped_string_end(body, backslash), True
        if quote >= 0:
            return quote, False
    return -1, False


def _escaped_string_end(body: bytes | bytearray, pos: int) -> int:
    """The first `"` at or after `pos` not escaped by an odd run of backslashes (-1 if none)."""
    while (quote := body.find(b'"', pos)) >= 0:
        run = 0
        while body[quote - 1 - run] == 0x5C:  # backslash
            run += 1
        if run % 2 == 0:
            return quote
        pos = quote + 1
    return -1


def _count_values(data: bytes | bytearray, limit: int) -> int:
    """1 + the `, : [ {` bytes outside strings, stopping once over `limit`. All of them
    first (cheap, an upper bound); only a body over the limit that way has its strings
    taken out (a regex that cannot backtrack) and is counted again."""
    count = _punctuation(data, limit)
    if count <= limit:
        return count
    return _punctuation(_JSON_STRING.sub(b'""', data), limit)


def _check_text_size(skeleton: bytes | bytearray, limit: int) -> None:
    """413 unless the body has at most `limit` characters, a JSON escape (`\\u00e9`, `\\n`)
    counted as one: what the tokenizer sees, whatever the client's encoder escaped (Python's
    json.dumps writes each non-ASCII character as 6 bytes). Above `_TEXT_BYTES_FACTOR` x the
    limit in bytes it is refused as it is: parsing that much would hold the GIL too long."""
    size = f"{len(skeleton)} bytes"
    if len(skeleton) <= _TEXT_BYTES_FACTOR * limit:
        try:
            chars = len(skeleton.decode("utf-8", "surrogatepass"))
        except UnicodeDecodeError:  # not UTF-8 (a UTF-16/32 body): counted in bytes
            chars = len(skeleton)
        unicode_escapes = skeleton.count(b"\\u")
        chars -= 5 * unicode_escapes + (skeleton.count(b"\\") - unicode_escapes)
        if chars <= limit:
            return
        size = f"about {chars} characters"
    raise RouterError(
        413,
        f"request body without its inline image data is {size}, above the limit of {limit} characters "
        "(limits.max_text_bytes)",
    )


_TEXT_BYTES_FACTOR = 6  # a \\uXXXX escape: 6 bytes for one character


def _punctuation(data: bytes | bytearray, limit: int) -> int:
    count = 1
    for offset in range(0, len(data), _PIECE):
        piece = data[offset : offset + _PIECE]
        count += piece.count(b",") + piece.count(b":") + piece.count(b"[") + piece.count(b"{")
        if count > limit:
            break
    return count


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _float_noting(overflowed: list[str]):
    """json's float hook: the value, with the text of any that is not finite noted."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            overflowed.append(text)
        return value

    return parse


def _not_finite(doc: Any, text: str) -> RouterError:
    """A 400 naming where the first non-finite number sits."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    where = "(somewhere)"
    while stack:
        value, path = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            where = _where(path)
            break
        if isinstance(value, dict):
            stack.extend((v, (*path, k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))
    shown = text if len(text) <= 40 else text[:40] + "..."
    return RouterError(
        400,
        f"invalid request: {where}: the number {shown} is beyond the range of a double; numbers must be finite",
        param=where,
    )


class _Walk:
    """One pass over the document, without recursion: depth, lone surrogates (keys too), and
    the lifted payloads, kept beside the document for image URLs and put back elsewhere."""

    def __init__(self, decoded: DecodedBody, lifted: list[memoryview | bytes], marker: str, max_depth: int) -> None:
        self.decoded = decoded
        self.lifted = lifted
        self.marker = marker
        self.max_depth = max_depth

    def run(self) -> None:
        root = [self.decoded.doc]
        stack: list[tuple[Any, Any, int, tuple[Any, ...]]] = [(root, 0, 1, ())]
        while stack:
            parent, key, depth, path = stack.pop()
            value = parent[key]
            if isinstance(value, str):
                parent[key] = self._text(value, path)
                continue
            if not isinstance(value, dict | list):
                continue
            if depth > self.max_depth:
                raise _too_deep(self.max_depth, path)
            if isinstance(value, list):
                stack.extend((value, i, depth + 1, (*path, i)) for i in range(len(value)))
                continue
            for name in list(value):
                checked = self._text(name, path, is_key=True)
                if checked is not name:
                    value[checked] = value.pop(name)
            stack.extend((value, name, depth + 1, (*path, name)) for name in value)
        self.decoded.doc = root[0]

    def _text(self, text: str, path: tuple[Any, ...], is_key: bool = False) -> str:
        if not text.isascii() and _SURROGATE.search(text):
            raise _surrogate(path, is_key)
        if not (self.lifted and self.marker in text):
            return text
        prefix, _, index = text.rpartition(self.marker)
        payload = self.lifted[int(index)]
        if not is_key and _is_image_url(path):
            self.decoded.inline[text] = payload
            return text
        return prefix + _as_text(payload, path)


def _is_image_url(path: tuple[Any, ...]) -> bool:
    """`messages.N.content.N.image_url.url`, or the bare-string form `messages.N.content.N.image_url`."""
    shape = tuple("N" if isinstance(p, int) else p for p in path)
    return shape in _IMAGE_URL_PATHS


_IMAGE_URL_PATHS = (
    ("messages", "N", "content", "N", "image_url", "url"),
    ("messages", "N", "content", "N", "image_url"),
)


def _as_text(payload: memoryview | bytes, path: tuple[Any, ...]) -> str:
    try:
        return str(payload, "utf-8")
    except UnicodeDecodeError:
        where = _where(path)
        raise RouterError(400, f"invalid request: {where} is not valid UTF-8", param=where) from None


def _where(path: tuple[Any, ...]) -> str:
    shown = ".".join(str(p) for p in path[:12]) + (".…" if len(path) > 12 else "")
    return shown or "(top level)"


def _surrogate(path: tuple[Any, ...], is_key: bool) -> RouterError:
    where = _where(path)
    what = "a key" if is_key else "text"
    return RouterError(
        400,
        f"invalid request: {where}: {what} with a lone UTF-16 surrogate (e.g. \\ud800); text must be valid Unicode",
        param=where,
    )


def _too_deep(limit: int, path: tuple[Any, ...]) -> RouterError:
    return RouterError(
        400, f"invalid request: JSON nested deeper than {limit} levels at {_where(path)} (limits.max_json_depth)"
    )
