"""Who an image job is for, and how many image jobs each client may hold at once.

The router names the client of the request being rendered in `current_client`
(`client_identity`: its API key, or its address when the router has no keys); tasks the
preprocessor starts inherit it (asyncio copies the context). `ClientSlots` bounds the image
jobs one client has running or queued (limits.image_jobs_per_client), so one client's images
cannot hold every image thread: the others' jobs go to the threads left. A slot is held until
the job's work has ended, not only until its client stops waiting (preprocessor.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextvars import ContextVar

# "" = unnamed (direct library use): all such jobs share one bound
current_client: ContextVar[str] = ContextVar("epd_preprocess_client", default="")


def client_identity(authorization: str | None, keys_checked: bool, address: str | None) -> str:
    """One name per client, however it dresses its requests: the key itself when the router
    checks keys (the scheme's case and the spaces around the key are not part of it:
    `bearer K` and `Bearer  K` are one client, as auth.py reads them), else the client's
    address without its port (a second connection is the same client; clients behind one
    proxy share a bound)."""
    if keys_checked and authorization:
        return "key:" + authorization.strip().partition(" ")[2].strip()
    return "addr:" + (address or "?")


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
        """Clients with a job running or waiting (what the tests watch to see a slot freed)."""
        return len(self._slots)
