"""Client API keys (Bearer tokens checked in constant time against a 0600 file), and the reading
of the other secret files the router holds (engine keys, the admin token: 0640 root:epd)."""

from __future__ import annotations

import hmac
import stat
from pathlib import Path

from epd_kit.plan.tenants_format import KeyFileError
from epd_kit.router.errors import RouterError


def load_api_keys(path: Path) -> tuple[bytes, ...]:
    """One key per line; blank lines and `#` comments ignored. Refuses a file that group or
    others can read (the keys would not be secret), and a key that is not printable ASCII."""
    return load_secret_lines(path, "api_keys_file", group_readable=False)


def read_secret_file(path: Path, setting: str, *, group_readable: bool) -> str:
    """The text of a file of secrets, refused when others (or, unless `group_readable`, the
    group) may read it: the error says which `chmod` to run."""
    try:
        st = path.stat()
    except OSError as exc:
        raise KeyFileError(f"{setting} {path}: cannot read: {exc.strerror or exc}") from None
    forbidden = stat.S_IRWXO if group_readable else stat.S_IRWXG | stat.S_IRWXO
    if st.st_mode & forbidden:
        who, mode = ("others", "640") if group_readable else ("group/others", "600")
        raise KeyFileError(
            f"{setting} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets {who} read it; run: chmod {mode} {path}"
        )
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise KeyFileError(f"{setting} {path}: cannot read: {reason or exc}") from None


def load_secret_lines(path: Path, setting: str, *, group_readable: bool, spaces: bool = True) -> tuple[bytes, ...]:
    """The secrets of a file, one a line, in order (blank lines and `#` comments ignored).
    `group_readable`: a root:epd 0640 file is fine (the kit's engine key and admin token; the
    router runs as a member of the group), never one others can read. Never names a secret in
    an error: only the setting, the file and the line number."""
    text = read_secret_file(path, setting, group_readable=group_readable)
    keys = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line and not line.startswith("#"):
            if not (line.isascii() and line.isprintable()) or (not spaces and " " in line):
                # an HTTP header carries a key as ASCII: such a key could never match
                raise KeyFileError(
                    f"{setting} {path}: line {number}: a key must be printable ASCII "
                    f"(no accented letters, no control characters{'' if spaces else ', no spaces'})"
                )
            keys.append(line.encode())
    if not keys:
        raise KeyFileError(f"{setting} {path}: contains no keys")
    return tuple(keys)


def bearer_matches(authorization: str | None, keys: tuple[bytes, ...]) -> bool:
    """Whether `authorization` is `Bearer <one of keys>`; every key compared, in constant time."""
    if not authorization or not keys:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = token.strip().encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key)
    return ok


class ApiKeyChecker:
    """`owners`: the tenant of each key (tenants.py; "" for a key without one), empty when no
    key has one."""

    def __init__(self, keys: tuple[bytes, ...] = (), owners: tuple[str, ...] = ()) -> None:
        self.keys = keys
        self.owners = owners

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> str | None:
        """Refuses a request without a valid key (401); the key's tenant, if it has one."""
        if not self.keys:
            return None
        if not authorization:
            raise RouterError(401, "missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise RouterError(401, "malformed Authorization header: expected 'Bearer <key>'")
        # compares against every key, so timing does not reveal which one matched
        given = token.strip().encode()
        matched = -1
        for index, key in enumerate(self.keys):
            if hmac.compare_digest(given, key):
                matched = index
        if matched < 0:
            raise RouterError(401, "invalid API key")
        return (self.owners[matched] or None) if self.owners else None
