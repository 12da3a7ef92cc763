#!/usr/bin/env python3
"""Build (once) the offline wheelhouse the targets install the kit from.

    build_wheelhouse.py --repo DIR --cache DIR --pin nixl==1.5.1 --pin nixl-cu12==1.5.1

Runs on the controller. The wheelhouse holds the kit's wheel, every dependency as a wheel,
and the pinned packages downloaded without their dependencies (the lean NIXL of the sim
backend, docs/sandbox.md). It is keyed by a hash of pyproject.toml, the kit's sources, the
pins and the controller's Python version, cached under --cache, and packed as one tar, so N
hosts and repeated runs reuse it. Third-party wheels are cached separately (keyed without the
kit's sources), so a code change rebuilds offline. Prints one JSON line: {key, archive, python, changed}.
With --dry-run (deploy --check) it builds, prunes and creates nothing: changed says whether a
build would run.
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
import tomllib
from pathlib import Path

SOURCE_SUFFIXES = {".py", ".json", ".jinja", ".j2", ".txt", ".typed", ".yaml", ".yml"}


def source_files(repo: Path) -> list[Path]:
    files = [repo / "pyproject.toml"]
    for path in sorted((repo / "router").rglob("*")):
        if (
            path.is_file()
            and path.suffix in SOURCE_SUFFIXES
            and "egg-info" not in str(path)
            and "__pycache__" not in path.parts
        ):
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


def pip_command() -> list[str]:
    # fail fast without an index (e.g. inside the test network namespace) instead of retrying for minutes
    return [
        sys.executable,
        "-m",
        "pip",
        "--disable-pip-version-check",
        "--no-input",
        "--retries",
        "1",
        "--timeout",
        "15",
    ]


def dependency_key(repo: Path) -> str:
    """What the kit's third-party wheels depend on: pyproject.toml and the Python version (the
    pins are downloaded apart, so the pinned and the unpinned wheelhouse share these)."""
    digest = hashlib.sha256(f"python{sys.version_info.major}.{sys.version_info.minor}\n".encode())
    digest.update((repo / "pyproject.toml").read_bytes())
    return digest.hexdigest()[:16]


def copy_source(repo: Path, destination: Path) -> Path:
    """The kit's sources, copied so the build leaves no build/ or egg-info in the repository."""
    shutil.copytree(repo / "router", destination / "router", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        if (repo / name).exists():
            shutil.copy2(repo / name, destination / name)
    return destination


def downloaded(target: Path, download) -> Path:
    """target, filled once by download(wheels_dir) (complete or absent: a broken download leaves nothing)."""
    if (target / ".complete").exists():
        return target
    with tempfile.TemporaryDirectory(prefix="epd-deps-") as tmp:
        wheels = Path(tmp) / "wheels"
        download(wheels, Path(tmp))
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(wheels, target)
    (target / ".complete").touch()
    return target


def dependency_wheels(repo: Path, cache: Path, pins: list[str]) -> list[Path]:
    """Third-party wheels (plus the build backend), downloaded once per dependency_key, and the
    pinned extras (--no-deps) once per pin set, beside them.

    Only this step needs a package index; a change of the kit's own code rebuilds its wheel
    offline from here (the air-gapped controller case)."""
    pip = pip_command()

    def kit_dependencies(wheels: Path, tmp: Path) -> None:
        source = copy_source(repo, tmp / "src")
        run(pip + ["wheel", "--quiet", "--wheel-dir", str(wheels), str(source)])
        for kit_wheel in wheels.glob("epd_kit-*.whl"):
            kit_wheel.unlink()
        backend = tomllib.loads((repo / "pyproject.toml").read_text())["build-system"]["requires"]
        run(pip + ["download", "--quiet", "--only-binary", ":all:", "--dest", str(wheels), *backend])

    deps = downloaded(cache / f"deps-{dependency_key(repo)}", kit_dependencies)
    if not pins:
        return [deps]
    pin_key = hashlib.sha256("\n".join(sorted(pins)).encode()).hexdigest()[:16]
    pinned = downloaded(
        deps / f"pins-{pin_key}",
        lambda wheels, _tmp: run(
            pip + ["download", "--quiet", "--no-deps", "--only-binary", ":all:", "--dest", str(wheels), *pins]
        ),
    )
    return [deps, pinned]


def build(repo: Path, target: Path, cache: Path, pins: list[str]) -> None:
    wheel_dirs = dependency_wheels(repo, cache, pins)
    with tempfile.TemporaryDirectory(prefix="epd-wheelhouse-") as tmp:
        kit = Path(tmp) / "kit"
        source = copy_source(repo, Path(tmp) / "src")
        # offline: the build backend comes from the dependency wheels
        run(
            pip_command()
            + [
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-index",
                "--find-links",
                str(wheel_dirs[0]),
                "--wheel-dir",
                str(kit),
                str(source),
            ]
        )
        tmp_tar = target.with_suffix(".tmp")
        with tarfile.open(tmp_tar, "w") as archive:
            for wheel in [w for d in wheel_dirs for w in sorted(d.glob("*.whl"))] + sorted(kit.glob("*.whl")):
                archive.add(wheel, arcname=wheel.name)
        os.replace(tmp_tar, target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--pin", action="append", default=[])
    parser.add_argument("--keep", type=int, default=3, help="archives kept in the cache (newest first)")
    parser.add_argument("--dry-run", action="store_true", help="report what would be built, change nothing")
    args = parser.parse_args()
    repo = args.repo.resolve()
    key = wheelhouse_key(repo, args.pin)
    archive = args.cache / f"epd-wheelhouse-{key}.tar"
    if args.dry_run:
        return report(key, archive, changed=not archive.exists())
    args.cache.mkdir(parents=True, exist_ok=True)
    changed = False
    # one builder at a time (parallel runs, several hosts' first deploys)
    with open(args.cache / ".lock", "w", encoding="ascii") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not archive.exists():
            build(repo, archive, args.cache, args.pin)
            changed = True
        else:
            os.utime(archive)  # used now: the pruning below keeps the most recently used, not built
        # keep the cache bounded: the newest few archives (other checkouts may still use them)
        archives = sorted(args.cache.glob("epd-wheelhouse-*.tar"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in [p for p in archives if p != archive][max(args.keep - 1, 0) :]:
            old.unlink(missing_ok=True)
        current_deps = f"deps-{dependency_key(repo)}"
        for old in args.cache.glob("deps-*"):
            if old.name != current_deps:
                shutil.rmtree(old, ignore_errors=True)
    return report(key, archive, changed)


def report(key: str, archive: Path, changed: bool) -> int:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    print(json.dumps({"key": key, "archive": str(archive), "changed": changed, "python": python}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
