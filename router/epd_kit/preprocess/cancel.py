"""Stopping image work nobody waits for any more: here, apart from image.py, so the
preprocessor's request path can use it without importing numpy and Pillow at start."""

from __future__ import annotations

import threading


class WorkCancelled(Exception):
    """Image work stopped because the request it was for has ended (nobody reads the error)."""


def stop_if(cancelled: threading.Event | None) -> None:
    """Between stages of image work: stop once nobody waits for the image any more."""
    if cancelled is not None and cancelled.is_set():
        raise WorkCancelled("the request this image was for has ended")
