"""Addresses and URLs: how an engine or the router is reached."""

from __future__ import annotations

import ipaddress

# Bind addresses that mean "every interface": probed on loopback.
WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "::", "[::]", ""})


def url(address: str, port: int) -> str:
    """http://address:port, with IPv6 addresses in brackets."""
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def probe_url(address: str, port: int) -> str:
    """Where a local probe reaches a service bound to `address` (a wildcard is probed on 127.0.0.1)."""
    return url("127.0.0.1" if address in WILDCARD_ADDRESSES else address, port)


# Names every resolver maps to loopback: /etc/hosts of Debian/RHEL/Amazon Linux, and any
# name under .localhost (RFC 6761 section 6.3).
LOOPBACK_NAMES = frozenset(
    {"localhost", "localhost.localdomain", "localhost4", "localhost6", "ip6-localhost", "ip6-loopback"}
)


def is_loopback(address: str) -> bool:
    name = address.strip().lower().rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False
