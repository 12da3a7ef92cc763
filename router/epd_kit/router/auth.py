"""Optional client API keys: Bearer tokens checked in constant time against a 0600 file."""

from __future__ import annotations

import hmac
import stat
from pathlib import Path

from epd_kit.router.errors import RouterError


class KeyFileError(ValueError):
    pass


def load_api_keys(path: Path) -> tuple[bytes, ...]:
    """One key per line; blank lines and `#` comments ignored. Refuses a file that group or
    others can read (the keys would not be secret), and a key that is not printable ASCII."""
    try:
        st = path.stat()
    except OSError as exc:
        raise KeyFileError(f"api_keys_file {path}: cannot read: {exc.strerror or exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"api_keys_file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group/others read "
            f"it; run: chmod 600 {path}"
        )
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"api_keys_file {path}: cannot read: {exc.strerror or exc}") from None
    keys = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line and not line.startswith("#"):
            if not (line.isascii() and line.isprintable()):
                # an HTTP header carries a key as ASCII: such a key could never match (issue 33)
                raise KeyFileError(
                    f"api_keys_file {path}: line {number}: a key must be printable ASCII "
                    "(no accented letters, no control characters)"
                )
            keys.append(line.encode())
    if not keys:
        raise KeyFileError(f"api_keys_file {path}: contains no keys")
    return tuple(keys)


class ApiKeyChecker:
    def __init__(self, keys: tuple[bytes, ...] = ()) -> None:
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> None:
        if not self.keys:
            return
        if not authorization:
            raise RouterError(401, "missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise RouterError(401, "malformed Authorization header: expected 'Bearer <key>'")
        given = token.strip().encode()
        # compare against every key so timing does not reveal which one matched
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise RouterError(401, "invalid API key")
