"""Who an image job is for, and how many image jobs each client may hold at once.

The router names the client of the request being rendered in `current_client` (its API key,
or its connection when the router has no keys); tasks the preprocessor starts inherit it
(asyncio copies the context). `ClientSlots` bounds the image jobs one client has running or
queued (limits.image_jobs_per_client), so one client's images cannot hold every image thread:
the others' jobs go to the threads left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextvars import ContextVar

# "" = unnamed (direct library use): all such jobs share one bound
current_client: ContextVar[str] = ContextVar("epd_preprocess_client", default="")


class ClientSlots:
    """Per-client semaphores, created on first use and dropped when idle (no growth with the
    number of clients ever seen)."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._slots: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, client: str) -> AsyncIterator[None]:
        entry = self._slots.get(client)
        if entry is None:
            entry = self._slots[client] = (asyncio.Semaphore(self.per_client), [0])
        semaphore, users = entry
        users[0] += 1
        try:
            async with semaphore:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._slots[client]

    def holders(self) -> int:
        """Clients with a job running or waiting (tests, metrics)."""
        return len(self._slots)
