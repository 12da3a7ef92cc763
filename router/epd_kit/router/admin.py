"""Who may read the operator endpoints (/metrics, /pools): a peer in `admin.networks`, or a
request with the admin token (`admin.token_file`). Everyone else is told there is no such
route (404), as for a path that does not exist: the endpoints are not advertised
(docs/security.md "Operator endpoints").

The peer is the TCP peer. Behind HAProxy that is the load balancer host, whatever client it
relays: a load balancer's address must not be in `admin.networks` (the plan refuses it), and
X-Forwarded-For is never read (anyone can send it).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from pathlib import Path

from epd_kit.router.auth import bearer_matches, load_secret_lines

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

LOOPBACK = ("127.0.0.0/8", "::1/128")
OPERATOR_PATHS = ("/metrics", "/pools")


def load_admin_tokens(path: Path | None) -> tuple[bytes, ...]:
    if path is None:
        return ()
    return load_secret_lines(path, "admin.token_file", group_readable=True, spaces=False)


class AdminGate:
    def __init__(self, networks: Sequence[str], tokens: tuple[bytes, ...] = ()) -> None:
        self.networks: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(n, strict=False) for n in networks)
        self.tokens = tokens

    def by_token(self, authorization: str | None) -> bool:
        return bearer_matches(authorization, self.tokens)

    def by_address(self, peer: str | None) -> bool:
        if not peer:
            return False
        try:
            address = ipaddress.ip_address(peer.split("%", 1)[0])  # an IPv6 zone
        except ValueError:
            return False  # a unix socket, a test client's name
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack listener's view of an IPv4 peer
        return any(address in network for network in self.networks)
