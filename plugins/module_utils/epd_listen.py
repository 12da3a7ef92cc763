"""Which of the given TCP ports are already listened on, and by whom: epd_listen_probe's check,
also run inside epd_host_state's read (the preflight reads the host and its ports in one run)."""

from __future__ import annotations

import os
import re

from ansible.module_utils.basic import AnsibleModule

OWN_UNIT = re.compile(r"epd-engine@[^/]*\.service|epd-router(@[^/]*)?\.service")
ROUTER_SOCKET = "epd-router.socket"
LISTEN = "0A"


def _address(hex_address: str) -> str:
    if len(hex_address) == 8:
        raw = bytes.fromhex(hex_address)[::-1]
        return ".".join(str(b) for b in raw)
    words = [bytes.fromhex(hex_address[i : i + 8])[::-1].hex() for i in range(0, 32, 8)]
    groups = "".join(words)
    return ":".join(groups[i : i + 4] for i in range(0, 32, 4))


def listening_sockets(ports: set[int]) -> dict[str, tuple[int, str]]:
    """inode -> (port, address) of LISTEN sockets on the wanted ports."""
    found: dict[str, tuple[int, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as handle:
                lines = handle.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            address, port_hex = fields[1].rsplit(":", 1)
            port = int(port_hex, 16)
            if port in ports:
                found[fields[9]] = (port, _address(address))
    return found


def socket_owners(inodes: set[str]) -> dict[str, list[int]]:
    """inode -> pids of the processes holding it (a listener systemd passes on has several)."""
    owners: dict[str, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    owners.setdefault(target[8:-1], []).append(int(pid))
        except OSError:
            continue
    return owners


def router_socket_ports(module: AnsibleModule) -> set[int]:
    """Ports of the router's socket unit (systemd holds them between router processes)."""
    rc, out, _ = module.run_command(["systemctl", "show", "--property=Listen", "--value", ROUTER_SOCKET])
    if rc != 0:
        return set()
    # one "ADDRESS:PORT (Stream)" entry per listener
    return {int(m) for m in re.findall(r":(\d+) \(Stream\)", out)}


def _read(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def probe(module: AnsibleModule, ports: list[int]) -> dict[str, list[dict]]:
    """{conflicts: listeners on the ports that are not the kit's, own: the kit's own units'}."""
    if not ports:  # no walk over every process's descriptors for nothing
        return {"conflicts": [], "own": []}
    sockets = listening_sockets(set(ports))
    owners = socket_owners(set(sockets))
    systemd_held = router_socket_ports(module) if any(1 in pids for pids in owners.values()) else set()
    conflicts, own = [], []
    for inode, (port, address) in sorted(sockets.items(), key=lambda item: item[1]):
        pids = owners.get(inode, [])
        pid = next((p for p in pids if p != 1), pids[0] if pids else None)
        entry = {
            "port": port,
            "address": address,
            "pid": pid,
            "process": _read(f"/proc/{pid}/cmdline") if pid else "unknown (socket owner not visible)",
        }
        in_own_unit = any(OWN_UNIT.search(_read(f"/proc/{p}/cgroup")) for p in pids if p != 1)
        if in_own_unit or (1 in pids and port in systemd_held):
            own.append(entry)
        else:
            conflicts.append(entry)
    return {"conflicts": conflicts, "own": own}
