"""The tenants file (`auth.tenants_file`, docs/router.md "Tenants"): which tenant each API key
belongs to and each tenant's limits. Parsing only, with the standard library: the controller's
inventory check (epd_kit.plan.tenants) applies the same rules before the kit renders the file.

    tenant acme requests_per_s=20 concurrent_requests=8 tokens_per_min=200000 images_per_min=120
    tenant beta                          # no limits
    key acme sk-...                      # a key of acme

A tenant line names each limit at most once (any may be left out: no limit of that kind); a
key line names a tenant defined in the file (a typo is refused naming its line). Keys follow
`auth.api_keys_file`'s rule (printable ASCII) and may not contain spaces.

Here, in the planner's package (stdlib only), because both sides read it: the planner renders
the file and checks the inventory with this parser (tenants.py; the collection's bundled planner
too, as it does router_yaml's settings check), the router loads it
(router/tenants.py). The router imports the planner, never the other way round.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


class KeyFileError(ValueError):
    pass


# the label count of the per-tenant metrics stays bounded by the table's size
MAX_TENANTS = 256
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
LIMITS = {
    "requests_per_s": float,
    "concurrent_requests": int,
    "tokens_per_min": int,
    "images_per_min": int,
}
# The longest Retry-After a 429 carries (a longer wait is cut to it: a client that honours it
# may be refused once more). The smallest rate keeps an ordinary refusal's wait below it.
RETRY_AFTER_MAX_S = 3600
# Each limit's range: what the buckets' arithmetic (floats, an i32 count per worker) and the
# Retry-After header hold. requests_per_s=1e-320 used to pass and make every request a 500
# (a division overflowing), 1e-300 a Retry-After of 300 digits.
BOUNDS: dict[str, tuple[float, float]] = {
    "requests_per_s": (0.001, 1_000_000),  # one request per 1000 s .. a million a second
    "concurrent_requests": (1, 1_000_000),
    "tokens_per_min": (1, 10**12),
    "images_per_min": (1, 10**9),
}


@dataclass(frozen=True)
class TenantLimits:
    requests_per_s: float | None = None
    concurrent_requests: int | None = None
    tokens_per_min: int | None = None
    images_per_min: int | None = None

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, name) is None for name in LIMITS)


@dataclass(frozen=True)
class TenantKeys:
    """A tenants file: each tenant's limits, and the keys with the tenant of each (same order)."""

    tenants: dict[str, TenantLimits]
    keys: tuple[bytes, ...]
    owners: tuple[str, ...]


def parse_tenants(text: str, where: str) -> TenantKeys:
    """The entries of a tenants file; `where` prefixes every error. An error names the line,
    never a key."""
    tenants: dict[str, TenantLimits] = {}
    key_lines: list[tuple[int, str, str]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        kind, _, rest = line.partition(" ")
        if kind == "tenant":  # a comment may follow (a key line has none: `#` may be in a key)
            rest = rest.split("#", 1)[0]
        fields = rest.split()
        at = f"{where}: line {number}"
        if kind == "tenant":
            if not fields:
                raise KeyFileError(f"{at}: 'tenant' needs a name: tenant NAME [requests_per_s=N ...]")
            name, settings = fields[0], fields[1:]
            _check_name(name, at)
            if name in tenants:
                raise KeyFileError(f"{at}: tenant {name!r} is defined twice")
            tenants[name] = _limits(name, settings, at)
        elif kind == "key":
            if len(fields) != 2:
                raise KeyFileError(f"{at}: expected 'key TENANT KEY' (a key has no spaces)")
            name, key = fields
            if not (key.isascii() and key.isprintable()):
                raise KeyFileError(f"{at}: a key must be printable ASCII (no accented letters, no control characters)")
            key_lines.append((number, name, key))
        else:
            raise KeyFileError(f"{at}: unknown entry {kind[:32]!r}: expected 'tenant NAME ...' or 'key TENANT KEY'")
    if len(tenants) > MAX_TENANTS:
        raise KeyFileError(f"{where}: {len(tenants)} tenants; at most {MAX_TENANTS} (each has its own metric series)")
    seen: dict[str, int] = {}
    for number, name, key in key_lines:
        if name not in tenants:
            known = ", ".join(sorted(tenants)[:10]) or "none"
            raise KeyFileError(
                f"{where}: line {number}: tenant {name!r} is not defined in this file (defined: {known})"
            )
        if key in seen:
            raise KeyFileError(f"{where}: line {number}: the same key as line {seen[key]}")
        seen[key] = number
    if not key_lines:
        raise KeyFileError(f"{where}: contains no keys")
    return TenantKeys(tenants, tuple(k.encode() for _, _, k in key_lines), tuple(n for _, n, _ in key_lines))


def _check_name(name: str, at: str) -> None:
    if not TENANT_NAME.match(name):
        raise KeyFileError(f"{at}: tenant name {name[:64]!r} must be 1-63 characters of [A-Za-z0-9_.-]")


def _limits(tenant: str, settings: list[str], at: str) -> TenantLimits:
    values: dict[str, float | int] = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or key not in LIMITS:
            raise KeyFileError(
                f"{at}: unknown limit {key[:40]!r}: expected NAME=VALUE with NAME one of {', '.join(LIMITS)}"
            )
        if key in values:
            raise KeyFileError(f"{at}: {key} is given twice")
        try:
            number = LIMITS[key](value)
        except ValueError:
            raise KeyFileError(
                f"{at}: {key}={value[:40]!r} is not a{'n integer' if LIMITS[key] is int else ' number'}"
            ) from None
        if not (math.isfinite(number) and number > 0):
            raise KeyFileError(f"{at}: {key} must be above 0 (leave it out for no limit)")
        low, high = BOUNDS[key]
        if not low <= number <= high:
            raise KeyFileError(
                f"{at}: tenant {tenant!r}: {key}={value[:40]} is outside the range the router serves, "
                f"{low:g} to {high:g} (leave it out for no limit)"
            )
        values[key] = number
    return TenantLimits(**values)
