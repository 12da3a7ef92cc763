"""Download (once) the NIXL wheels the transfer-probe tests install into their small venvs.

    python -m tests.hosts.nixl_wheels      prints the wheel directory

nixl 1.5.1 is a meta package (Requires-Dist nixl-cu12==1.5.1, nixl-cu13==1.5.1) that picks its
backend at import from torch's CUDA major, so tests/ansible/test_transfer_probe.py needs both
backends' real wheels. The tests run where no package index is reachable (the kithub
namespace), so tests/hosts/wheelhouse.py calls `ensure()` beforehand; the tests skip, saying
so, when the directory is incomplete. No dependencies but numpy, which the backends declare
(Requires-Dist: torch, numpy) and import; the tests bring their own torch stand-in.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".cache/nixl-wheels"
VERSION = "1.5.1"
DISTRIBUTIONS = ("nixl", "nixl-cu12", "nixl-cu13")
NUMPY = "2.4.6"  # the sandbox's engine venv pins the same (tests/hosts/standins/build.py)
# the test hosts' and the kit venv's interpreter (Debian bookworm: 3.11); the backends are cp311 wheels
PYTHON_VERSION = "3.11"
PLATFORM = "manylinux_2_28_x86_64"  # the tag the backends' wheels carry


def wheel_glob(dist: str) -> str:
    return f"{dist.replace('-', '_')}-{VERSION}-*.whl"


def numpy_glob() -> str:
    return f"numpy-{NUMPY}-*.whl"


def present(directory: Path = WHEELS) -> bool:
    wanted = [wheel_glob(dist) for dist in DISTRIBUTIONS] + [numpy_glob()]
    return all(any(directory.glob(pattern)) for pattern in wanted)


def download(target: Path) -> None:
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    argv += ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", "cp311", "--platform", PLATFORM]
    argv += ["--dest", str(target), *(f"{dist}=={VERSION}" for dist in DISTRIBUTIONS), f"numpy=={NUMPY}"]
    subprocess.run(argv, check=True)


def ensure(directory: Path = WHEELS) -> Path:
    """The directory with the three wheels, downloaded into a staging directory the first time."""
    if present(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{directory}.lock", "w", encoding="ascii") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not present(directory):
            with tempfile.TemporaryDirectory(prefix="nixl-wheels-", dir=directory.parent) as staging:
                download(Path(staging))
                shutil.rmtree(directory, ignore_errors=True)
                shutil.copytree(staging, directory)
                directory.chmod(0o755)
    return directory


def main() -> int:
    try:
        print(f"nixl wheels: {ensure()}")
    except subprocess.CalledProcessError as error:
        print(f"nixl wheels: download failed ({error}); tests/ansible/test_transfer_probe.py will skip")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
