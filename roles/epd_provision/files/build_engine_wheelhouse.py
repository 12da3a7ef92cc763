#!/usr/bin/env python3
"""Build (once) the offline wheelhouse of the engine venv: vllm, vllm-neuron, NIXL.

    build_engine_wheelhouse.py --cache DIR --requirement vllm==0.24.0 --requirement nixl==1.5.1
        [--index-url URL] [--extra-index-url URL] [--find-links DIR_OR_URL] [--no-deps] [--dry-run]

Runs on the controller, so a fleet downloads the engine stack from the package indexes once
instead of once per host. The archive is keyed by the requirements, the sources, --no-deps and
the controller's Python version (the wheels are built for it: the hosts' Python must match),
cached under --cache and packed as one tar. Prints one JSON line: {key, archive, python, changed}.
With --dry-run (provision --check) nothing is downloaded or written: changed says whether a
build would run.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def wheelhouse_key(args: argparse.Namespace) -> str:
    inputs = {
        "python": python_version(),
        "requirements": sorted(args.requirement),
        "no_deps": args.no_deps,
        "index_url": args.index_url,
        "extra_index_urls": args.extra_index_url,
        "find_links": args.find_links,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def download(args: argparse.Namespace, destination: Path) -> None:
    # fail fast without an index (e.g. inside the test network namespace) instead of retrying for minutes
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--retries", "1"]
    argv += ["--timeout", "15", "download", "--quiet", "--only-binary", ":all:", "--dest", str(destination)]
    argv += ["--index-url", args.index_url]
    for url in args.extra_index_url:
        argv += ["--extra-index-url", url]
    for link in args.find_links:
        argv += ["--find-links", link]
    if args.no_deps:
        argv.append("--no-deps")
    result = subprocess.run(argv + args.requirement, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-2000:] + result.stderr[-4000:])
        raise SystemExit(f"engine wheelhouse: pip download exited {result.returncode}")


def build(args: argparse.Namespace, archive: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="epd-engine-wheelhouse-") as tmp:
        wheels = Path(tmp)
        download(args, wheels)
        partial = archive.with_suffix(".tmp")
        with tarfile.open(partial, "w") as tar:
            for wheel in sorted(wheels.glob("*.whl")):
                tar.add(wheel, arcname=wheel.name)
        os.replace(partial, archive)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--requirement", action="append", required=True)
    parser.add_argument("--index-url", default="https://pypi.org/simple")
    parser.add_argument("--extra-index-url", action="append", default=[])
    parser.add_argument("--find-links", action="append", default=[])
    parser.add_argument("--no-deps", action="store_true", help="download each requirement without its dependencies")
    parser.add_argument("--dry-run", action="store_true", help="report what would be built, change nothing")
    args = parser.parse_args()
    key = wheelhouse_key(args)
    archive = args.cache / f"engine-wheelhouse-{key}.tar"
    changed = not archive.exists()
    if changed and not args.dry_run:
        args.cache.mkdir(parents=True, exist_ok=True)
        with open(args.cache / ".lock", "w", encoding="ascii") as lock:  # one builder at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not archive.exists():
                build(args, archive)
    print(json.dumps({"key": key, "archive": str(archive), "python": python_version(), "changed": changed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
