"""Drive the local systemd-nspawn test hosts (tests/hosts/hosts.sh) from Python.

The shell script owns booting, networking and teardown; this module only calls it and
offers the helpers tests need: `systemctl -M`, commands inside a host, ssh, journal,
and writing Ansible inventories that point at the hosts. Names and addresses reserved
for tests and the demo: n1-n9 = 10.213.0.11-19 (docs/sandbox.md).
"""

from __future__ import annotations

import atexit
import math
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

from tests.budget import describe, factor, scaled

HOSTS_DIR = Path(__file__).resolve().parent
HOSTS_SH = HOSTS_DIR / "hosts.sh"
REPO = HOSTS_DIR.parent.parent
HUB_NETNS = "kithub"
NET_PREFIX = "10.213.0"
# the controller's address on the hub bridge (hosts.sh net-up): inside kithub, the one address of
# the tests' side that the test hosts reach (a server a deployed host must call listens here)
HUB_ADDRESS = f"{NET_PREFIX}.1"
# where the sandbox checkpoint lives on every host (inventory/sandbox uses this path)
HOST_MODEL_DIR = "/models/tiny-qwen3-vl"
# what epd_deps leaves on a host: the kit's venv (with its wheelhouse marker) and the shipped
# archive (the defaults of epd_kit_venv and epd_deps_host_wheelhouse_dir; HostPool.capture_kit)
KIT_INSTALL_VARIABLES = ("epd_kit_venv", "epd_deps_host_wheelhouse_dir")


# scripts/test.sh runs tests/e2e as two pytest processes at once (EPD_E2E_LANE=a|b, docs/sandbox.md),
# each on machines of its own. Tests always name hosts n1, n2, ... with the inventory addresses
# 10.213.0.11, ...; a lane with an offset k runs host n<i> on the machine n<i+k>. The offset is
# applied where a name or address meets a machine: HostPool.host, machine_address (a URL a test
# builds) and relocated/write_inventory/copy_inventory (the addresses an inventory holds).
LANE_HOST_OFFSET = {"a": 0, "b": 5}  # lane a: n1-n5, lane b: n6-n9 (its modules use n1-n4)
_INVENTORY_ADDRESS = re.compile(re.escape(NET_PREFIX) + r"\.1([1-9])\b")


def host_address(index: int) -> str:
    """n<index> lives at 10.213.0.(10+index) in the inventories; index 1..9."""
    if not 1 <= index <= 9:
        raise ValueError(f"test host index {index} outside the reserved n1-n9")
    return f"{NET_PREFIX}.{10 + index}"


def host_offset() -> int:
    lane = os.environ.get("EPD_E2E_LANE", "a")
    if lane not in LANE_HOST_OFFSET:
        raise ValueError(f"EPD_E2E_LANE={lane!r}: the lanes are {sorted(LANE_HOST_OFFSET)}")
    return LANE_HOST_OFFSET[lane]


def machine_address(index: int) -> str:
    """The address of the machine that plays host n<index> in this lane."""
    if index + host_offset() > 9:
        raise ValueError(f"host n{index} in lane {os.environ.get('EPD_E2E_LANE')} would be n{index + host_offset()}")
    return host_address(index + host_offset())


def relocated(value):
    """`value` (a string, or lists and dicts of them) with every inventory address of a host
    n1-n9 replaced by its machine's address in this lane."""
    if isinstance(value, str):
        return _INVENTORY_ADDRESS.sub(lambda m: machine_address(int(m.group(1))), value)
    if isinstance(value, list):
        return [relocated(v) for v in value]
    if isinstance(value, dict):
        return {k: relocated(v) for k, v in value.items()}
    return value


def copy_inventory(source: Path, dest: Path) -> Path:
    """A copy of an inventory directory, relocated to this lane's machines."""
    shutil.copytree(source, dest)
    for path in dest.rglob("*.yml"):
        path.write_text(relocated(path.read_text()))
    return dest


def hosts_env() -> dict[str, str]:
    """The settings hosts.sh resolves (KIT_DIR, BASE, STATE, SSH_KEY, ...)."""
    out = subprocess.run([str(HOSTS_SH), "env"], check=True, capture_output=True, text=True).stdout
    env: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        env[key] = shlex.split(value)[0] if value else ""
    return env


def in_hub_netns() -> bool:
    """True when this process runs inside the kithub network namespace."""
    try:
        return os.stat("/proc/self/ns/net").st_ino == os.stat(f"/run/netns/{HUB_NETNS}").st_ino
    except OSError:
        return False


def environment_problem() -> str | None:
    """Why the real-systemd tier cannot run here, or None."""
    if os.geteuid() != 0:
        return "the real-systemd tier needs root"
    if not in_hub_netns():
        return (
            f"pytest is not running inside the '{HUB_NETNS}' network namespace, so the test "
            "hosts are unreachable (and must stay isolated)"
        )
    return None


def run(
    argv: list[str],
    *,
    check: bool = True,
    timeout: float = 120,
    input: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """subprocess.run with text output; on failure the error carries stdout and stderr.
    `timeout` is a base budget, scaled to the machine (tests/budget.py)."""
    proc = _bounded(argv, timeout, input=input, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed (rc={proc.returncode}): {shlex.join(argv)}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


@dataclass(frozen=True)
class TestHost:
    """One booted test host. Unit-file operations (enable/is-enabled/cat) go through
    `run()` inside the host: `systemctl -M` would answer them from the controller's
    /etc (docs/sandbox.md)."""

    __test__ = False  # not a pytest test class
    name: str
    address: str
    ssh_key: str = field(repr=False, default="")

    def leader_pid(self) -> int:
        for line in Path(f"/run/systemd/machines/{self.name}").read_text().splitlines():
            if line.startswith("LEADER="):
                return int(line.split("=", 1)[1])
        raise AssertionError(f"{self.name}: no LEADER in /run/systemd/machines/{self.name}")

    def path(self, inside: str) -> Path:
        """A path inside the running host, seen from the controller (read only please)."""
        return Path(f"/proc/{self.leader_pid()}/root") / inside.lstrip("/")

    def systemctl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run(["systemctl", "-M", self.name, "--no-pager", *args], check=check, timeout=timeout)

    def run(self, command: str, *, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run a shell command inside the host (all its namespaces, as root)."""
        return run(
            ["nsenter", "-t", str(self.leader_pid()), "-a", "/bin/sh", "-c", command], check=check, timeout=timeout
        )

    def ssh(self, command: str, *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run(["ssh", *ssh_options(self.ssh_key), f"root@{self.address}", command], check=check, timeout=timeout)

    def is_active(self, unit: str) -> str:
        return self.systemctl("is-active", unit, check=False).stdout.strip()

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"-p{p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_process(self, unit: str) -> tuple[str, list[str], dict[str, str]]:
        """The PID, argv and environment of a unit's main process, as it runs (not as the unit
        file says: what an engine was started with)."""
        pid = self.show(unit, "MainPID")["MainPID"]
        argv = self.run(f"tr '\\0' '\\n' < /proc/{pid}/cmdline").stdout.splitlines()
        environ = self.run(f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout.splitlines()
        return pid, argv, dict(line.partition("=")[::2] for line in environ)

    def units(self, pattern: str) -> list[str]:
        """Loaded units matching a glob, e.g. 'epd-engine@*'."""
        out = self.systemctl("list-units", "--all", "--plain", "--no-legend", pattern).stdout
        return sorted(line.split()[0] for line in out.splitlines() if line.strip())

    def journal(self, unit: str, lines: int = 200) -> str:
        return self.run(f"journalctl --no-pager -q -n {lines} -u {shlex.quote(unit)}", check=False).stdout


def ssh_options(key: str) -> list[str]:
    return [
        "-i",
        key,
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "ConnectTimeout=3",
    ]


class HostPool:
    """Boots and stops hosts n1..n9 through hosts.sh; remembers what it started."""

    def __init__(self, seed: Path | None = None) -> None:
        self.env = hosts_env()
        self.seed = seed
        self.seed_problem: str | None = None
        # a copy of the kit as epd_deps installed it on a host of this session (capture_kit)
        self.kit_seed: Path | None = None
        self.started: dict[str, TestHost] = {}
        self.boots: dict[str, int] = {}  # host -> how often it was booted or stopped (see `generation`)

    def generation(self, names: Iterable[str]) -> tuple[int, ...]:
        """Changes whenever one of these hosts is re-booted or stopped: what was deployed on them
        at one generation is still there only while the generation is the same."""
        return tuple(self.boots.get(name, 0) for name in names)

    def require_model(self) -> None:
        """Fail the calling test when the hosts carry no sandbox checkpoint."""
        if self.seed is None:
            raise AssertionError(f"the test hosts have no sandbox model: {self.seed_problem}")

    def _script(self, *args: str, timeout: float = 180, extra_env: dict[str, str] | None = None) -> str:
        # hosts.sh's own boot and sshd polls scale with the machine too (a whole factor)
        env = dict(os.environ, EPD_WAIT_FACTOR=str(math.ceil(factor())), **(extra_env or {}))
        return run([str(HOSTS_SH), *args], timeout=timeout, env=env).stdout

    def host(self, index: int) -> TestHost:
        """The machine that plays host n<index> in this lane (host_offset)."""
        return TestHost(f"n{index + host_offset()}", machine_address(index), self.env["SSH_KEY"])

    def index(self, host: TestHost) -> int:
        """The host number tests use for this machine (the inverse of `host`)."""
        return int(host.name[1:]) - host_offset()

    def shared_dir(self, name: str, *, fresh: bool = True) -> Path:
        """A controller directory for `up(..., shared=...)`: $KIT_DIR/shared/<name>, emptied when fresh."""
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,40}", name):
            raise ValueError(f"bad shared directory name {name!r}")
        directory = Path(self.env["KIT_DIR"]) / "shared" / name
        if fresh and directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def up(
        self,
        *indexes: int,
        seed: bool = True,
        kit: bool = False,
        shared: tuple[Path, str] | None = None,
        variant: str | None = None,
    ) -> list[TestHost]:
        """Boot fresh hosts (a running one is stopped and wiped first). kit=True: with the kit
        already installed when one was captured (capture_kit), so a deploy skips the install.
        shared=(DIR, PATH): every host of this call sees the controller's DIR (from `shared_dir`)
        at PATH, one file system for all of them (hosts.sh SHARED=: the sandbox's NFS/FSx share).
        variant: the base rootfs (hosts.sh VARIANT=dlami|bare; dlami when not given)."""
        hosts = [self.host(i) for i in indexes]
        extra = {"FRESH": "1"}
        if variant is not None:
            extra["VARIANT"] = variant
        if seed and self.seed is not None:
            extra["SEED"] = str(self.seed)
        if kit and self.kit_seed is not None:
            extra["LAYERS"] = str(self.kit_seed)  # read-only under the host's own files: nothing to copy
        if shared is not None:
            extra["SHARED"] = f"{shared[0]}:{shared[1]}"
        for h in hosts:
            self.boots[h.name] = self.boots.get(h.name, 0) + 1
        self._script("up", *(f"{h.name}:{h.address}" for h in hosts), extra_env=extra)
        self.started.update({h.name: h for h in hosts})
        return hosts

    def capture_kit(self, host: TestHost, directory: Path) -> Path:
        """Copy what epd_deps installed on `host` (its venv, marker included, and the shipped
        wheelhouse archive) into `directory`, a layer for later boots (`up(..., kit=True)`). The copy
        is the kit's own install, byte for byte; the marker names the wheelhouse it came from, so
        a deploy of another kit (an upgrade test, other pins) still installs for real."""
        # imported here: the vLLM-compat tier loads this module in a venv without the kit
        from epd_kit.plan.variables import default

        upper = Path(self.env["STATE"]) / host.name / "upper"
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        for path in (default(name).lstrip("/") for name in KIT_INSTALL_VARIABLES):
            if not (upper / path).is_dir():
                raise AssertionError(f"{host.name} has no {'/' + path}: the kit is not installed there")
            shutil.copytree(upper / path, tmp / path, symlinks=True)
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
        self.kit_seed = directory
        return directory

    def ensure(self, count: int) -> list[TestHost]:
        """Hosts n1..n<count>, booting only the ones not running yet."""
        missing = [i for i in range(1, count + 1) if not self.is_running(self.host(i).name)]
        if missing:
            self.up(*missing)
        return [self.host(i) for i in range(1, count + 1)]

    def is_running(self, name: str) -> bool:
        listed = self._script("list").split()
        return name in listed[::2]

    def reset(self, host: TestHost, *, seed: bool = True) -> TestHost:
        """A pristine host again (wiped overlay, fresh boot): about 1-2 s."""
        return self.up(self.index(host), seed=seed)[0]

    def down(self, *hosts: TestHost) -> None:
        names = [h.name for h in hosts] or list(self.started)
        for name in names:
            self.boots[name] = self.boots.get(name, 0) + 1
        if names:
            self._script("down", *names)
        for name in names:
            self.started.pop(name, None)


def write_inventory(directory: Path, base: Path, hosts_yml: dict, group_vars: dict | None = None) -> Path:
    """An inventory directory: `base`'s group_vars (copied), the given hosts.yml and
    extra group_vars/all overrides (written as group_vars/all/zz-test.yml, so they win).
    Addresses of hosts n1-n9 are written relocated to this lane's machines (`relocated`)."""
    directory.mkdir(parents=True, exist_ok=True)
    for part in ("group_vars", "host_vars"):
        for source in sorted((base / part).rglob("*")):
            dest = directory / source.relative_to(base)
            if source.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(relocated(source.read_text()))
    (directory / "hosts.yml").write_text(yaml.safe_dump(relocated(hosts_yml), sort_keys=False))
    if group_vars:
        all_dir = directory / "group_vars" / "all"
        if (directory / "group_vars" / "all.yml").exists():
            all_dir.mkdir(exist_ok=True)
            shutil.move(directory / "group_vars" / "all.yml", all_dir / "main.yml")
        all_dir.mkdir(parents=True, exist_ok=True)
        (all_dir / "zz-test.yml").write_text(yaml.safe_dump(relocated(group_vars), sort_keys=False))
    return directory


@dataclass
class PlaybookResult:
    returncode: int
    stdout: str
    stderr: str
    recap: dict[str, dict[str, int]]  # host -> {ok, changed, unreachable, failed, skipped, ...}

    @property
    def changed(self) -> int:
        return sum(r.get("changed", 0) for r in self.recap.values())

    def describe(self) -> str:
        return f"rc={self.returncode}\n--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-3000:]}"


_RECAP_LINE = re.compile(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$")


@cache
def _ssh_control_dir() -> str:
    """This test process's own directory for Ansible's ssh master connections. The default
    (~/.ansible/cp) is shared by every run on the machine: a master that an interrupted run left
    open to an address whose host has since been re-booted made the next run's playbook hang."""
    directory = tempfile.mkdtemp(prefix="epd-cp-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def playbook_command(
    inventory: Path | str, playbook: str, *args: str, env: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ansible-playbook as the tests run it (from the repo root)."""
    argv = [str(REPO / ".venv/bin/ansible-playbook"), "-i", str(inventory), str(REPO / playbook), *args]
    full_env = dict(
        os.environ,
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_SSH_CONTROL_PATH_DIR=_ssh_control_dir(),
        **(env or {}),
    )
    full_env["PATH"] = f"{REPO / '.venv/bin'}:{full_env.get('PATH', '/usr/bin:/bin')}"
    return argv, full_env


def _bounded(argv: list[str], base_s: float, **kwargs) -> subprocess.CompletedProcess[str]:
    """subprocess.run within `base_s` scaled to the machine; past it, an error that names the
    command, the budget and the output so far (subprocess kills the child)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=scaled(base_s), check=False, **kwargs)
    except subprocess.TimeoutExpired as exc:
        out = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr)]
        raise AssertionError(
            f"still running after {describe(base_s)}, stopped: {shlex.join(argv)}\n"
            f"--- stdout (last 4000)\n{out[0][-4000:]}\n--- stderr\n{out[1][-4000:]}"
        ) from None


def ansible_playbook(
    inventory: Path | str, playbook: str, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> PlaybookResult:
    """Run ansible-playbook from the repo root (its ansible.cfg) and parse the recap. `timeout`:
    the base budget (a quiet machine's), scaled to the machine (tests/budget.py)."""
    argv, full_env = playbook_command(inventory, playbook, *args, env=env)
    proc = _bounded(argv, timeout, cwd=REPO, env=full_env)
    recap: dict[str, dict[str, int]] = {}
    in_recap = False
    for line in proc.stdout.splitlines():
        if line.startswith("PLAY RECAP"):
            in_recap = True
            continue
        match = _RECAP_LINE.match(line.strip()) if in_recap else None
        if match:
            recap[match.group(1)] = {k: int(v) for k, v in (kv.split("=") for kv in match.group(2).split())}
    return PlaybookResult(proc.returncode, proc.stdout, proc.stderr, recap)
