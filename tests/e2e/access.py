"""The access rules as the end-to-end tests see them (docs/security.md "Who can reach what"): the
members of one set of a host's `table inet epd_kit`, and a bounded port scan of a test host from
the controller (only the sandbox's own 10.213.0.x hosts, every connect at most 1 s)."""

from __future__ import annotations

import ipaddress
import json
import socket
from concurrent.futures import ThreadPoolExecutor

from tests.hosts.harness import NET_PREFIX, TestHost

# the kit's port ranges in the sandbox's plans (and a margin), HAProxy and its statistics page
KIT_PORTS = (*range(14600, 14616), *range(18100, 18108), *range(18300, 18308), 18800, 8080, 8404)


def nft_set(host: TestHost, name: str) -> list[str]:
    """The addresses and networks of set `name` in the kit's table on `host`, sorted."""
    out = json.loads(host.run(f"nft -j list set inet epd_kit {name}").stdout)
    elements = next(item["set"] for item in out["nftables"] if "set" in item).get("elem", [])
    members = []
    for element in elements:
        prefix = element.get("prefix") if isinstance(element, dict) else None
        members.append(f"{prefix['addr']}/{prefix['len']}" if prefix else str(element))
    return sorted(members, key=lambda m: ipaddress.ip_network(m, strict=False))


def listening_ports(host: TestHost) -> set[int]:
    """Every TCP port `host` listens on, on any address but loopback."""
    ports = set()
    for line in host.run("ss -Hltn").stdout.splitlines():
        local = line.split()[3]
        address, _, port = local.rpartition(":")
        if not ipaddress.ip_address(address.strip("[]").split("%")[0].replace("*", "0.0.0.0")).is_loopback:
            ports.add(int(port))
    return ports


def _is_open(address: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((address, port)) == 0


def open_ports(host: TestHost) -> list[int]:
    """The ports a client outside the fleet (the controller) can connect to on `host`: every port it
    listens on and the kit's ranges, each tried once."""
    if not host.address.startswith(f"{NET_PREFIX}."):
        raise AssertionError(f"{host.address} is not a sandbox test host")
    ports = sorted(listening_ports(host) | {22, *KIT_PORTS})
    with ThreadPoolExecutor(max_workers=16) as pool:
        found = pool.map(lambda port: (port, _is_open(host.address, port)), ports)
        return sorted(port for port, is_open in found if is_open)
