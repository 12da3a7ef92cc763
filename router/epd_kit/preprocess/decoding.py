"""Image decode under a hard time budget: a decode that cannot be interrupted runs where it
can be stopped.

Pillow's decoders run in C to the end of the image once started: a thread cannot stop them,
and a progressive JPEG's cost is pixels x scans (image.py bounds the scans; an 8192x8192 one
of 64 scans still costs seconds). So an image above `limits.image_decode_inline_pixels` is
decoded and resized (`image.decode_resized`) in a child process, which is killed when the
decode outlives `limits.image_decode_timeout_s` (a 400, `ImageDecodeTooSlow`) or when nobody
waits for the image any more: the CPU is freed the moment the budget ends, not when the
decode would. Only the resized image comes back (at most `max_image_patches` patches).

Smaller images, the common case, decode in the image thread as before: their cost is
bounded by their pixels and `max_jpeg_scans` (2048x2048 with 64 scans: ~0.5 s on one core
of the test machine), and the hop to a process would cost more than the work for most
(docs/preprocessing.md, "Decode budget", has the figures).

Children come from a `forkserver` (never a `fork` of the threaded router) with this module
preloaded, so a replacement starts in milliseconds; at most one per image thread, each
serving one image at a time, kept for the next. A child whose parent dies reads EOF and
exits.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from PIL import Image

from .cancel import WorkCancelled
from .errors import ImageDecodeTooSlow, NotAnImage, PreprocessError
from .image import Decoded, decode_resized, open_image
from .model_files import VisionSettings
from .settings import Limits

# how often a waiting image thread looks at the request's cancellation
_POLL_S = 0.05


@functools.cache  # (two threads racing here set the same preload twice: harmless)
def _forkserver() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # numpy, Pillow and this module, imported once
    return ctx


def source_pixels(data: bytes, limits: Limits) -> int:
    """width x height from the image's header (0 when it does not parse: the decode in the
    thread then raises the error the client gets)."""
    try:
        with open_image(data, limits) as image:
            width, height = image.size
    except Exception:  # Pillow raises many types for data that is not an image
        return 0
    return width * height


def _serve(conn: Connection, limits: Limits, vision: VisionSettings) -> None:
    """The child: one image's bytes in, its `Decoded` (or the error) out, until EOF."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            answer: tuple[bool, object] = (True, decode_resized(data, limits, vision))
        except PreprocessError as exc:
            answer = (False, exc)
        except Exception as exc:  # decode_image wraps decoder errors; anything else is a bug
            answer = (False, NotAnImage(f"the image could not be decoded ({exc})"))
        del data
        conn.send(answer)


class _Child:
    def __init__(self, limits: Limits, vision: VisionSettings) -> None:
        ours, theirs = multiprocessing.Pipe()
        self.conn = ours
        self.process: BaseProcess = _forkserver().Process(
            target=_serve, args=(theirs, limits, vision), name="epd-image-decode", daemon=True
        )
        self.process.start()
        theirs.close()

    def kill(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class ImageDecoder:
    """`decode(data, cancelled)`: the image decoded and resized, in this thread or in a child
    process under the budget. Thread-safe: image threads take a child each."""

    def __init__(self, limits: Limits, vision: VisionSettings) -> None:
        self._limits = limits
        self._vision = vision
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._closed = False
        self.killed = 0  # children stopped mid-decode (budget or cancel): tests, metrics

    def decode(self, data: bytes, cancelled: threading.Event | None = None) -> Decoded:
        limits = self._limits
        if source_pixels(data, limits) <= limits.image_decode_inline_pixels:
            return decode_resized(data, limits, self._vision, cancelled)
        return self._in_child(data, cancelled)

    def _in_child(self, data: bytes, cancelled: threading.Event | None) -> Decoded:
        child = self._take()
        budget = self._limits.image_decode_timeout_s
        give_up = time.monotonic() + budget
        try:
            child.conn.send_bytes(data)
            while not child.conn.poll(_POLL_S):
                if cancelled is not None and cancelled.is_set():
                    raise WorkCancelled("the request this image was for has ended")
                if time.monotonic() >= give_up:
                    raise ImageDecodeTooSlow(
                        f"the image did not decode within {budget:g}s (limits.image_decode_timeout_s); "
                        "send it smaller, or as a baseline (not progressive) JPEG or a PNG"
                    )
            ok, value = child.conn.recv()
        except (WorkCancelled, ImageDecodeTooSlow):
            self.killed += 1
            child.kill()
            raise
        except (EOFError, OSError):  # the child died (a decoder crash, the OOM killer)
            child.kill()
            raise NotAnImage("the image decoder ended while decoding the image") from None
        except BaseException:
            child.kill()
            raise
        self._give_back(child)
        if not ok:
            assert isinstance(value, BaseException)
            raise value
        assert isinstance(value, Decoded) and isinstance(value.resized, Image.Image)
        return value

    def _take(self) -> _Child:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.process.is_alive():
                    return child
                child.kill()
        return _Child(self._limits, self._vision)

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(child)
                return
        child.kill()

    def close(self) -> None:
        """Stop the idle children (one busy now is stopped when its image thread gives it back)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()
