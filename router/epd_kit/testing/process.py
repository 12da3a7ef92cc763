"""One home for the process plumbing of the sim launcher, the benches and the tests: start a
child with its output in a log file, wait until an HTTP endpoint answers 200 (failing fast,
with the log, if the child exits), and stop it by its own pid.

Standard library only (the vLLM-compat venv imports it too). Loopback use: nothing here picks
hosts; every wait is bounded.
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from signal import SIGTERM
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


# Ports free_port handed out in this process. The kernel may return a port again once the
# probing socket is closed, before the first caller's child has bound it: two engines of one
# stack then got the same port, one failed to bind, and the other answered for both (a VE's
# /health made the missing PD look ready). Never hand out a port twice.
_handed_out: set[int] = set()


def free_port(host: str = LOOPBACK) -> int:
    """A port the kernel just handed out on `host`, never one this process handed out before
    (free now; the caller binds it soon after)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no fresh port on {host} after 100 tries ({len(_handed_out)} handed out)")


def http_status(url: str, timeout: float = 1.0, ca: str | None = None) -> int | None:
    """GET `url` (no proxy, no redirects; https verified with the CA file `ca`); its status, or
    None if nothing answered."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        context = ssl.create_default_context(cafile=ca)
        connection: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname or LOOPBACK, parts.port or 443, timeout=timeout, context=context
        )
    else:
        connection = http.client.HTTPConnection(parts.hostname or LOOPBACK, parts.port or 80, timeout=timeout)
    try:
        connection.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
        return connection.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


def http_ok(url: str, timeout: float = 1.0, ca: str | None = None) -> bool:
    return http_status(url, timeout, ca) == 200


class ProcessFailed(RuntimeError):
    """A child exited, or did not get ready in time; the message carries its log."""


class ManagedProcess:
    """One child process; stdout+stderr go to `log_path`. Always `stop()` it in a finalizer."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        new_session: bool = True,
        pass_fds: Sequence[int] = (),
        append_log: bool = False,
    ) -> None:
        self.argv, self.log_path = list(argv), Path(log_path)
        self.name = name or Path(self.argv[0]).name
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab" if append_log else "wb") as log:  # the child keeps its own descriptor
            self.popen = subprocess.Popen(
                self.argv,
                env=dict(os.environ if env is None else env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # its own session: a signal meant for the test run (Ctrl-C) reaches it only through stop()
                start_new_session=new_session,
                pass_fds=tuple(pass_fds),
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def check_running(self) -> None:
        if self.popen.poll() is not None:
            raise ProcessFailed(f"{self.name} (pid {self.pid}) exited with {self.popen.returncode}:\n{self.log_tail()}")

    def wait_until(
        self, ready: Callable[[], bool], timeout: float, what: str = "ready", interval: float = 0.05
    ) -> ManagedProcess:
        """Poll `ready()` until true; raise at once if the child exits, and after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_running()
            if ready():
                return self
            if time.monotonic() >= deadline:
                raise ProcessFailed(f"{self.name} (pid {self.pid}) not {what} after {timeout} s:\n{self.log_tail()}")
            time.sleep(interval)

    def wait_http(
        self, url: str, timeout: float = 30.0, interval: float = 0.05, ca: str | None = None
    ) -> ManagedProcess:
        """Until GET `url` answers 200 (a health or readiness endpoint; https verified with `ca`)."""
        return self.wait_until(lambda: http_ok(url, ca=ca), timeout, f"answering 200 on {url}", interval)

    def wait_exit(self, timeout: float = 20.0) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise ProcessFailed(
                f"{self.name} (pid {self.pid}) still running after {timeout} s:\n{self.log_tail()}"
            ) from exc

    def signal(self, sig: int = SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self, timeout: float = 10.0, sig: int = SIGTERM) -> int:
        """`sig` (SIGTERM: a graceful stop), SIGKILL after `timeout` s; this child only."""
        self.signal(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.wait(10)


def stop_all(processes: Sequence[ManagedProcess], timeout: float = 10.0) -> None:
    """Signal every process first, then wait for each: teardown in parallel."""
    for process in processes:
        process.signal(SIGTERM)
    for process in processes:
        process.stop(timeout)
