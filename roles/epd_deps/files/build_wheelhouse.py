#!/usr/bin/env python3
"""Build (once) the offline wheelhouse the targets install the kit from.

    build_wheelhouse.py --repo DIR --cache DIR --pin nixl==1.5.1 --pin nixl-cu12==1.5.1

Runs on the controller. The wheelhouse holds the kit's wheel, every dependency as a wheel,
and the pinned packages downloaded without their dependencies (the lean NIXL of
test-hosts.md section E). It is keyed by a hash of pyproject.toml, the kit's sources, the
pins and the controller's Python version, cached under --cache, and packed as one tar, so N
hosts and repeated runs reuse it. Prints one JSON line: {key, archive, python, changed}.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SOURCE_SUFFIXES = {".py", ".json", ".jinja", ".j2", ".txt", ".typed", ".yaml", ".yml"}


def source_files(repo: Path) -> list[Path]:
    files = [repo / "pyproject.toml"]
    for path in sorted((repo / "router").rglob("*")):
        if path.is_file() and path.suffix in SOURCE_SUFFIXES and "egg-info" not in str(path) and "__pycache__" not in path.parts:
            files.append(path)
    return files


def wheelhouse_key(repo: Path, pins: list[str]) -> str:
    digest = hashlib.sha256()
    digest.update(f"python{sys.version_info.major}.{sys.version_info.minor}\n".encode())
    for pin in sorted(pins):
        digest.update(f"pin {pin}\n".encode())
    for path in source_files(repo):
        digest.update(str(path.relative_to(repo)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def run(argv: list[str]) -> None:
    result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-4000:])
        raise SystemExit(f"wheelhouse build failed: {' '.join(argv)} exited {result.returncode}")


def build(repo: Path, target: Path, pins: list[str]) -> None:
    # fail fast without an index (e.g. inside the test network namespace) instead of retrying for minutes
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "15"]
    with tempfile.TemporaryDirectory(prefix="epd-wheelhouse-") as tmp:
        wheels = Path(tmp) / "wheels"
        # build from a copy so the repository gets no build/ or egg-info litter
        source = Path(tmp) / "src"
        shutil.copytree(repo / "router", source / "router", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
        for name in ("pyproject.toml", "README.md"):
            if (repo / name).exists():
                shutil.copy2(repo / name, source / name)
        run(pip + ["wheel", "--quiet", "--wheel-dir", str(wheels), str(source)])
        if pins:
            run(pip + ["download", "--quiet", "--no-deps", "--only-binary", ":all:", "--dest", str(wheels), *pins])
        tmp_tar = target.with_suffix(".tmp")
        with tarfile.open(tmp_tar, "w") as archive:
            for wheel in sorted(wheels.iterdir()):
                archive.add(wheel, arcname=wheel.name)
        os.replace(tmp_tar, target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--pin", action="append", default=[])
    parser.add_argument("--keep", type=int, default=3, help="archives kept in the cache (newest first)")
    args = parser.parse_args()
    repo = args.repo.resolve()
    key = wheelhouse_key(repo, args.pin)
    args.cache.mkdir(parents=True, exist_ok=True)
    archive = args.cache / f"epd-wheelhouse-{key}.tar"
    changed = False
    # one builder at a time (parallel runs, several hosts' first deploys)
    with open(args.cache / ".lock", "w", encoding="ascii") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not archive.exists():
            build(repo, archive, args.pin)
            changed = True
        # keep the cache bounded: the newest few archives (other checkouts may still use them)
        archives = sorted(args.cache.glob("epd-wheelhouse-*.tar"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in [p for p in archives if p != archive][max(args.keep - 1, 0):]:
            old.unlink(missing_ok=True)
    print(json.dumps({"key": key, "archive": str(archive), "changed": changed,
                      "python": f"{sys.version_info.major}.{sys.version_info.minor}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
