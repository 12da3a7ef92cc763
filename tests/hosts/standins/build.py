"""Build the stand-ins for AWS's Neuron apt repository, EFA installer and Neuron pip packages.

    python -m tests.hosts.standins.build      prints the stand-in directory (built once, cached)

The Neuron and EFA repositories are out of reach here, so the provisioning tests
(tests/e2e/test_provision_hosts.py) install from local stand-ins with the same package names and
version scheme, checked the same way (a signed apt repository, an installer tarball with a
sha256). Every stand-in says so in its description and installs no driver, no kernel module
and no Neuron code. Real parts: the EFA installer stand-in bundles Debian's real libfabric1
(+ libfabric-bin and the dependencies the bare test image lacks), downloaded with
`apt-get download`; NIXL comes from PyPI through the engine wheelhouse. Needs the network
(Debian mirror) the first time: run it outside the kithub namespace (tests/hosts/wheelhouse.py).

Layout of the cached directory (served over http from 10.213.0.1 inside kithub by the tests):

    apt/          dists/<suite>/{InRelease,Release,Release.gpg,main/binary-amd64/Packages}, pool/*.deb,
                  GPG-PUB-KEY-EPD-STANDIN.PUB (the signing key; the real one is GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB)
    efa/          aws-efa-installer-<version>.tar.gz (+ .sha256)
    pip/          vllm and vllm-neuron stand-in wheels (local version label +standin, never on PyPI)
    manifest.json the releases below with the installer checksums
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from email.utils import formatdate
from pathlib import Path

SUITE = "bookworm"  # the test hosts' codename: the role points apt at <repository> <codename> main
NEURON_PACKAGES = ("aws-neuronx-dkms", "aws-neuronx-runtime-lib", "aws-neuronx-collectives", "aws-neuronx-tools")
# Debian packages the EFA installer stand-in bundles (the real installer bundles libfabric-aws)
EFA_DEBIAN_PACKAGES = ("libfabric1", "libfabric-bin")
STANDIN_NOTE = "STAND-IN built by the epd-kit test harness: not AWS software, no driver, no kernel module"


@dataclass(frozen=True)
class Release:
    """One set of pins, as the role's variables take them."""

    neuron: dict[str, str]  # apt package -> upstream version (the role pins <version>*)
    efa_installer: str
    vllm: str
    vllm_neuron: str


# A: the Neuron 2.26.1 component versions (release content page) and EFA installer 1.41.0;
# B: the same with newer stand-in versions, for the upgrade and rollback tests.
RELEASE_A = Release(
    neuron={
        "aws-neuronx-dkms": "2.24.7.0",
        "aws-neuronx-runtime-lib": "2.28.23.0",
        "aws-neuronx-collectives": "2.28.27.0",
        "aws-neuronx-tools": "2.26.14.0",
    },
    efa_installer="1.41.0",
    vllm="0.24.0+standin",
    vllm_neuron="0.4.0+standin",
)
RELEASE_B = Release(
    neuron={
        "aws-neuronx-dkms": "2.24.8.0",
        "aws-neuronx-runtime-lib": "2.28.24.0",
        "aws-neuronx-collectives": "2.28.28.0",
        "aws-neuronx-tools": "2.26.15.0",
    },
    efa_installer="1.41.1",
    vllm="0.24.0+standin",
    vllm_neuron="0.4.1+standin",
)
RELEASES = {"a": RELEASE_A, "b": RELEASE_B}
DEB_REVISION = "standin1"  # Debian revision of every stand-in package: <upstream>-standin1

HERE = Path(__file__).resolve().parent


def kit_dir() -> Path:
    return Path(os.environ.get("KIT_DIR", "/var/tmp/epd-kit"))


def cache_key() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def standin_dir() -> Path:
    return kit_dir() / f"standins-{cache_key()}"


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"stand-ins: {' '.join(argv)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


# --- apt repository -------------------------------------------------------------------------


def build_deb(pool: Path, package: str, version: str, work: Path) -> None:
    root = work / f"{package}_{version}"
    doc = root / "usr/share/doc" / package
    doc.mkdir(parents=True)
    (doc / "STAND-IN").write_text(f"{package} {version}\n{STANDIN_NOTE}\n")
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN/control").write_text(
        f"Package: {package}\nVersion: {version}-{DEB_REVISION}\nArchitecture: amd64\n"
        "Maintainer: epd-kit test harness <nobody@invalid>\nSection: misc\nPriority: optional\n"
        f"Description: STAND-IN for AWS {package} (epd-kit tests only)\n {STANDIN_NOTE}.\n"
    )
    run(
        [
            "dpkg-deb",
            "--root-owner-group",
            "--build",
            str(root),
            str(pool / f"{package}_{version}-{DEB_REVISION}_amd64.deb"),
        ]
    )


def release_file(dists: Path) -> str:
    lines = [
        "Origin: epd-kit-standin",
        "Label: STAND-IN Neuron repository (epd-kit tests)",
        f"Suite: {SUITE}",
        f"Codename: {SUITE}",
        f"Date: {formatdate(usegmt=True)}",
        "Architectures: amd64",
        "Components: main",
        f"Description: {STANDIN_NOTE}",
        "SHA256:",
    ]
    for path in sorted(p for p in dists.rglob("*") if p.is_file()):
        data = path.read_bytes()
        lines.append(f" {hashlib.sha256(data).hexdigest()} {len(data)} {path.relative_to(dists)}")
    return "\n".join(lines) + "\n"


def build_apt_repository(target: Path, work: Path) -> None:
    pool = target / "pool"
    pool.mkdir(parents=True)
    for release in RELEASES.values():
        for package, version in release.neuron.items():
            if not (pool / f"{package}_{version}-{DEB_REVISION}_amd64.deb").exists():
                build_deb(pool, package, version, work)
    dists = target / "dists" / SUITE
    binary = dists / "main/binary-amd64"
    binary.mkdir(parents=True)
    packages = run(["dpkg-scanpackages", "--multiversion", "pool", "/dev/null"], cwd=target).stdout
    (binary / "Packages").write_text(packages)
    (dists / "Release").write_text(release_file(dists))
    # a throwaway signing key, like the repository's own; apt on the hosts checks the signature
    gnupg = work / "gnupg"
    gnupg.mkdir(mode=0o700)
    gpg = ["gpg", "--homedir", str(gnupg), "--batch", "--quiet", "--pinentry-mode", "loopback", "--passphrase", ""]
    run([*gpg, "--quick-gen-key", "epd-kit STAND-IN Neuron repository (tests only)", "ed25519", "sign", "never"])
    run([*gpg, "--clearsign", "--output", str(dists / "InRelease"), str(dists / "Release")])
    run([*gpg, "--armor", "--detach-sign", "--output", str(dists / "Release.gpg"), str(dists / "Release")])
    (target / "GPG-PUB-KEY-EPD-STANDIN.PUB").write_text(run([*gpg, "--armor", "--export"]).stdout)


# --- EFA installer ----------------------------------------------------------------------------

INSTALLER = """#!/bin/bash
# {note}
# Takes the real efa_installer.sh's options; installs the bundled Debian libfabric packages
# and records what it installed in /opt/amazon/efa_installed_packages like the real one.
set -euo pipefail
cd "$(dirname "$0")"
for option in "$@"; do
  case "$option" in
    -y|--yes|-k|--skip-kmod|-l|--skip-limit-conf|-n|--no-verify|-m|--minimal|-g|--enable-gdr|-d|--debug-packages) ;;
    *) echo "efa_installer.sh (stand-in): unknown option $option" >&2; exit 2 ;;
  esac
done
apt-get install -y --no-install-recommends ./DEBS/*.deb
mkdir -p /opt/amazon
{{
  echo "# EFA installer version: {version}"
  echo "# Debug packages installed: no"
  echo "# {note}"
  dpkg-query -W -f '${{Package}} ${{Version}}\\n' {packages}
}} > /opt/amazon/efa_installed_packages
"""


def missing_from(rootfs: Path, packages: tuple[str, ...]) -> list[str]:
    """What apt would install on that rootfs for these packages (the packages and their missing
    dependencies): a simulation against the rootfs's dpkg status."""
    argv = ["apt-get", "--simulate", "-o", f"Dir::State::status={rootfs / 'var/lib/dpkg/status'}"]
    out = run([*argv, "install", "--no-install-recommends", *packages]).stdout
    return [line.split()[1] for line in out.splitlines() if line.startswith("Inst ")]


def build_efa_installers(target: Path, work: Path, bare_rootfs: Path) -> None:
    debs = work / "efa-debs"
    debs.mkdir()
    run(["apt-get", "download", *missing_from(bare_rootfs, EFA_DEBIAN_PACKAGES)], cwd=debs)
    target.mkdir(parents=True)
    for release in RELEASES.values():
        version = release.efa_installer
        tree = work / f"efa-{version}" / "aws-efa-installer"
        shutil.copytree(debs, tree / "DEBS")
        script = tree / "efa_installer.sh"
        script.write_text(INSTALLER.format(note=STANDIN_NOTE, version=version, packages=" ".join(EFA_DEBIAN_PACKAGES)))
        script.chmod(0o755)
        (tree / "README.STAND-IN").write_text(STANDIN_NOTE + "\n")
        tarball = target / f"aws-efa-installer-{version}.tar.gz"
        with tarfile.open(tarball, "w:gz") as archive:
            archive.add(tree, arcname="aws-efa-installer")
        digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
        (target / f"{tarball.name}.sha256").write_text(f"{digest}  {tarball.name}\n")


# --- pip stand-ins ------------------------------------------------------------------------------


def build_wheel(target: Path, dist: str, version: str, module: str, console_script: str | None) -> None:
    """A pure-python wheel: <module>/__init__.py that says it is a stand-in (+ a console script)."""
    stem = f"{dist.replace('-', '_')}-{version}"
    files = {
        f"{module}/__init__.py": f'"""{STANDIN_NOTE}."""\n\n__version__ = "{version}"\nSTANDIN = True\n\n\n'
        "def main() -> int:\n"
        f'    print("{dist} {version}: {STANDIN_NOTE}")\n'
        "    return 1\n",
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        f"Summary: STAND-IN for {dist} (epd-kit tests only)\n",
        f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: epd-kit-standins\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    if console_script:
        files[f"{stem}.dist-info/entry_points.txt"] = f"[console_scripts]\n{console_script} = {module}:main\n"
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{stem}.dist-info/RECORD,,")
    files[f"{stem}.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(target / f"{stem}-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


def build_pip_standins(target: Path) -> None:
    target.mkdir(parents=True)
    for release in RELEASES.values():
        if not any(target.glob(f"vllm-{release.vllm}-*.whl")):
            build_wheel(target, "vllm", release.vllm, "vllm", "vllm")
        if not any(target.glob(f"vllm_neuron-{release.vllm_neuron}-*.whl")):
            build_wheel(target, "vllm-neuron", release.vllm_neuron, "vllm_neuron", None)


# --- the role's variables for the stand-ins -----------------------------------------------------------

SERVER = "http://10.213.0.1:18780"  # the tests serve the stand-in directory here, inside kithub only
# NIXL exactly as the sim backend's lean install (docs/sandbox.md): no torch/CUDA stack
ENGINE_EXTRA_REQUIREMENTS = ["nixl-cu12==1.5.1", "numpy==2.4.6"]
NIXL_VERSION = "1.5.1"


def provision_vars(release_name: str, target: Path | None = None, server: str = SERVER) -> dict:
    """epd_provision_* for a release of the stand-ins served at `server` (the sandbox's pins)."""
    release = RELEASES[release_name]
    target = target or standin_dir()
    efa_tarball = f"aws-efa-installer-{release.efa_installer}.tar.gz"
    return {
        "epd_provision_neuron_apt_repository": f"{server}/apt",
        "epd_provision_neuron_apt_key_url": f"{server}/apt/GPG-PUB-KEY-EPD-STANDIN.PUB",
        "epd_provision_neuron_apt_suite": SUITE,
        "epd_provision_neuron_driver_version": release.neuron["aws-neuronx-dkms"],
        "epd_provision_neuron_runtime_version": release.neuron["aws-neuronx-runtime-lib"],
        "epd_provision_neuron_collectives_version": release.neuron["aws-neuronx-collectives"],
        "epd_provision_neuron_tools_version": release.neuron["aws-neuronx-tools"],
        "epd_provision_neuron_kernel_headers": False,  # no kernel build here: the stand-in dkms has no module
        "epd_provision_neuron_check_devices": False,  # no Neuron device in a container
        "epd_provision_efa_installer_version": release.efa_installer,
        "epd_provision_efa_installer_url": f"{server}/efa/{efa_tarball}",
        "epd_provision_efa_installer_sha256": manifest(target)["efa_sha256"][efa_tarball],
        "epd_provision_efa_check_provider": False,  # Debian's libfabric has no efa provider (no EFA device either)
        "epd_provision_vllm_version": release.vllm,
        "epd_provision_vllm_neuron_version": release.vllm_neuron,
        "epd_provision_nixl_version": NIXL_VERSION,
        "epd_provision_engine_extra_requirements": ENGINE_EXTRA_REQUIREMENTS,
        "epd_provision_engine_resolve_dependencies": False,
        "epd_provision_engine_pip_extra_index_urls": [],
        "epd_provision_engine_pip_find_links": [str(target / "pip")],
        "epd_engine_venv": "/opt/epd/engine-venv",
    }


def engine_wheelhouse_argv(variables: dict) -> list[str]:
    """The role's build_engine_wheelhouse.py arguments for these variables (validate.yml builds the same)."""
    defaults = {"epd_provision_engine_pip_index_url": "https://pypi.org/simple"}
    merged = {**defaults, **variables}
    requirements = [
        f"vllm=={merged['epd_provision_vllm_version']}",
        f"vllm-neuron=={merged['epd_provision_vllm_neuron_version']}",
        f"nixl=={merged['epd_provision_nixl_version']}",
        *merged["epd_provision_engine_extra_requirements"],
    ]
    argv = ["--index-url", merged["epd_provision_engine_pip_index_url"]]
    argv += [f"--requirement={r}" for r in requirements]
    argv += [f"--extra-index-url={u}" for u in merged["epd_provision_engine_pip_extra_index_urls"]]
    argv += [f"--find-links={link}" for link in merged["epd_provision_engine_pip_find_links"]]
    if not merged["epd_provision_engine_resolve_dependencies"]:
        argv.append("--no-deps")
    return argv


# --- all --------------------------------------------------------------------------------------------


def bare_rootfs() -> Path:
    out = run([str(HERE.parent / "hosts.sh"), "env"], env=dict(os.environ, VARIANT="bare"))
    for line in out.stdout.splitlines():
        if line.startswith("BASE="):
            return Path(line.split("=", 1)[1])
    raise SystemExit("stand-ins: hosts.sh env printed no BASE")


def build(target: Path) -> None:
    rootfs = bare_rootfs()
    if not (rootfs / "var/lib/dpkg/status").exists():
        raise SystemExit(f"stand-ins: no bare rootfs at {rootfs}: run 'tests/hosts/hosts.sh prepare' first")
    with tempfile.TemporaryDirectory(prefix="epd-standins-") as tmp:
        work = Path(tmp)
        staging = work / "out"
        build_apt_repository(staging / "apt", work)
        build_efa_installers(staging / "efa", work, rootfs)
        build_pip_standins(staging / "pip")
        manifest = {
            "note": STANDIN_NOTE,
            "suite": SUITE,
            "releases": {name: asdict(release) for name, release in RELEASES.items()},
            "efa_sha256": {
                p.name.removesuffix(".sha256"): p.read_text().split()[0] for p in (staging / "efa").glob("*.sha256")
            },
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(staging, target)


def ensure() -> Path:
    """The stand-in directory, built once per version of this file."""
    target = standin_dir()
    if (target / "manifest.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w", encoding="ascii") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "manifest.json").exists():
            build(target)
    return target


def manifest(target: Path | None = None) -> dict:
    return json.loads(((target or standin_dir()) / "manifest.json").read_text())


if __name__ == "__main__":
    print(ensure())
    sys.exit(0)
