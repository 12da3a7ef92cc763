"""The key the router shows the engines (vLLM's `--api-key` / VLLM_API_KEY; docs/security.md
"Engine keys").

`engine_auth.key_file` holds the current key on its first line and, during a rotation, the
previous one on the second. Requests carry the key that last worked for that engine (the first
at start); an engine that answers 401 gets the other key on the same request, once, and keeps
it while it works: while a rolling restart moves engines from the old key to the new one, no
request fails. vLLM checks the key only on paths under /v1, /v2 and /inference
(wire.KEY_GUARDED_PATHS, from vLLM's code), so only those carry it.
"""

from __future__ import annotations

from pathlib import Path

from epd_kit.router.auth import load_secret_lines
from epd_kit.wire import KEY_GUARDED_PATHS


def load_engine_keys(path: Path | None) -> tuple[bytes, ...]:
    """The keys of `engine_auth.key_file` (current first); none without a file. A key with a
    space could not pass vLLM's check (it splits the header on its first space and keeps the
    rest whole, but systemd's EnvironmentFile and the kit's writers would need quoting)."""
    if path is None:
        return ()
    keys = load_secret_lines(path, "engine_auth.key_file", group_readable=True, spaces=False)
    if len(keys) > 2:
        raise ValueError(f"engine_auth.key_file {path}: {len(keys)} keys; at most 2 (the current, the previous)")
    return keys


class EngineKeys:
    """Which key each engine origin gets. Read and switched on the event loop only."""

    __slots__ = ("_chosen", "keys")

    def __init__(self, keys: tuple[bytes, ...] = ()) -> None:
        self.keys = keys
        self._chosen: dict[str, int] = {}  # origin -> index of the key that last worked

    def header(self, origin: str, path: str) -> bytes:
        """The `authorization` header line for a request to `origin` + `path` (b"" if none)."""
        if not self.keys or not path.startswith(KEY_GUARDED_PATHS):
            return b""
        return b"authorization: Bearer " + self.keys[self._chosen.get(origin, 0)] + b"\r\n"

    def index(self, origin: str) -> int:
        return self._chosen.get(origin, 0)

    def refused(self, origin: str, index: int) -> bool:
        """`origin` answered 401 to the key at `index`: move it to the other key, unless a
        concurrent request did already. True when there is another key to try."""
        if len(self.keys) < 2:
            return False
        if self._chosen.get(origin, 0) == index:
            self._chosen[origin] = (index + 1) % len(self.keys)
        return True
