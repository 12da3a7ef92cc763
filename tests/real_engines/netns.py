"""Two network namespaces joined by a veth, and a port of one reached from 127.0.0.1.

For engines that must not share a network stack (UCX picks `cma`, a same-kernel copy, between
processes of one namespace even with UCX_TLS naming tcp; two namespaces force TCP over the veth):

    with VethPair("nxu-ve", "nxu-pd", ("10.231.0.1", "10.231.0.2")) as pair:
        ["ip", "netns", "exec", pair.left.name, ...]       # a process inside the left namespace
        with NamespacePort(pair.left.name, 8000) as port:  # 127.0.0.1:port.port -> its 127.0.0.1:8000
            ...

Root is needed (ip netns). Nothing outside the two namespaces is changed: the veth is created
with its ends inside them, the root namespace gets no address or route; the test reaches an
engine through NamespacePort, a forwarder whose outgoing sockets are opened from a thread moved
into the namespace (setns(2) moves only the calling thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000  # <sched.h>
PREFIX = 24


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class End:
    name: str  # the namespace
    device: str  # its end of the veth
    address: str

    def rx_bytes(self) -> int:
        """The bytes this end received (the kernel's counter of the device)."""
        return int(ip("netns", "exec", self.name, "cat", f"/sys/class/net/{self.device}/statistics/rx_bytes"))

    def exec_argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]


class VethPair:
    """Namespaces `left` and `right` (each with lo up), a veth between them, one address each."""

    def __init__(self, left: str, right: str, addresses: tuple[str, str], devices: tuple[str, str] = ("nxu0", "nxu1")):
        self.left = End(left, devices[0], addresses[0])
        self.right = End(right, devices[1], addresses[1])

    def __enter__(self) -> VethPair:
        for end in (self.left, self.right):
            if Path(f"/var/run/netns/{end.name}").exists():  # left behind by a killed run of this test
                ip("netns", "del", end.name)
        try:
            for end in (self.left, self.right):
                ip("netns", "add", end.name)
                ip("-n", end.name, "link", "set", "lo", "up")
            ip(
                "link", "add", self.left.device, "netns", self.left.name, "type", "veth",
                "peer", "name", self.right.device, "netns", self.right.name,
            )  # fmt: skip
            for end in (self.left, self.right):
                ip("-n", end.name, "addr", "add", f"{end.address}/{PREFIX}", "dev", end.device)
                ip("-n", end.name, "link", "set", end.device, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for end in (self.left, self.right):  # deleting a namespace deletes its veth end, and so the pair
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", end.name)


def enter_netns(name: str) -> None:
    """Move the calling thread into namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


class NamespacePort:
    """127.0.0.1:`port` (a free port of the root namespace) forwarded to `target_port` on the
    127.0.0.1 of namespace `netns`, one thread per connection, for the `with` block's life."""

    def __init__(self, netns: str, target_port: int) -> None:
        self.netns = netns
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))  # made here: in the root namespace
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"port-{netns}", daemon=True)

    def __enter__(self) -> NamespacePort:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(10)

    def _serve(self) -> None:
        enter_netns(self.netns)  # this thread's sockets from here on (and its threads') are the namespace's
        self._listener.settimeout(0.5)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        except OSError:
            client.close()  # the engine is not listening yet: the caller sees a closed connection
            return
        with client, upstream, selectors.DefaultSelector() as selector:
            selector.register(client, selectors.EVENT_READ, upstream)
            selector.register(upstream, selectors.EVENT_READ, client)
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.5):
                    data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                    if not data:
                        return
                    key.data.sendall(data)


@contextlib.contextmanager
def namespace_beside_host(name: str, inside: End, host_device: str, host_address: str):
    """Namespace `name` joined to this host's network stack by a veth: `inside` (its device and
    address) in the namespace, `host_device` with `host_address` on the host. A leftover of an
    earlier run of the same names is removed first; both are removed afterwards."""
    subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", host_device], check=False, capture_output=True, timeout=30)
    ip("netns", "add", name)
    try:
        ip("link", "add", host_device, "type", "veth", "peer", "name", inside.device)
        ip("link", "set", inside.device, "netns", name)
        ip("addr", "add", f"{host_address}/{PREFIX}", "dev", host_device)
        ip("link", "set", host_device, "up")
        ip("-n", name, "addr", "add", f"{inside.address}/{PREFIX}", "dev", inside.device)
        ip("-n", name, "link", "set", inside.device, "up")
        ip("-n", name, "link", "set", "lo", "up")
        yield
    finally:
        subprocess.run(["ip", "link", "del", host_device], check=False, capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=30)
