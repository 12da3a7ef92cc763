"""Build the stand-ins for AWS's Neuron apt repository, EFA installer and Neuron pip packages.

    python -m tests.hosts.standins.build      prints the stand-in directory (built once, cached)

The Neuron and EFA repositories are out of reach here, so the provisioning tests
(tests/e2e/test_provision_hosts.py) install from local stand-ins with the same package names and
version scheme, checked the same way (a signed apt repository, an installer tarball with a
detached signature and a sha256, wheels whose metadata pip resolves). Every stand-in says so in
its description and installs no driver, no kernel module and no Neuron code. Each fails where
the real part fails, flag by flag:
- the EFA installer takes efa_installer.sh's options (its usage text): --minimal installs the
  kernel module and rdma-core only (no libfabric), --skip-kmod no kernel module, and without
  --skip-kmod it needs the running kernel's headers (exit_kernel_hdr_not_installed);
- aws-neuronx-dkms, like dkms, fails to install without the running kernel's headers
  (linux-headers-<uname -r>, a stand-in package in the same repository);
- libfabric (under /opt/amazon/efa, as the real installer puts it) is a stub with the ABI
  NIXL's LIBFABRIC plugin links (symbol versions up to FABRIC_1.10; Debian bookworm's
  libfabric 1.17 stops at FABRIC_1.6) and no provider, like a host without an EFA interface;
- the CUDA driver stub (cuda-cudart-dev-12-6) and cuda-cudart-12-6 are stub libraries with the
  symbols the plugin links, in a CUDA repository of their own that only a cuda-keyring package
  (its sources list and key) opens, as the setup guide reaches NVIDIA's; hwloc is Debian's real libhwloc15;
- the pip stand-ins carry the real distribution names (vllm, vllm-neuron, libtorch-neuronx-lite,
  neuronx-cc, nki, torch, ...), version <pin>+standin, and the real packages' Requires-Dist lines
  that name the torch family, the Neuron packages and NIXL (PIP_STANDINS says where each comes
  from): pip's resolver fails on the sandbox's wheels where it fails on a real host.
NIXL (and numpy, protobuf, psutil) are the real wheels from PyPI, downloaded here. Needs the
network (Debian mirror, PyPI) and a C compiler the first time: run it outside the kithub
namespace (tests/hosts/wheelhouse.py).

Layout of the cached directory (served over http from 10.213.0.1 inside kithub by the tests):

    apt/          dists/<suite>/{InRelease,Release,Release.gpg,main/binary-amd64/Packages}, pool/*.deb,
                  GPG-PUB-KEY-EPD-STANDIN.PUB (the signing key; the real one is GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB)
    efa/          aws-efa-installer-<version>.tar.gz (+ .sig, .sha256), aws-efa-installer.key
    cuda/         a flat signed repository (InRelease, Packages) with the CUDA stub packages
    cuda-keyring_1.0-1_all.deb   its sources list and key, as NVIDIA's cuda-keyring package carries them
    pip/          stand-in wheels (local version label +standin) and the real wheels they require
    empty-index/  the engine wheelhouse's --index-url: nothing, so every wheel comes from pip/
    manifest.json the releases below, the installer checksums and signing key
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

from epd_kit.plan.neuron_releases import DEFAULT_RELEASE, neuron_release
from epd_kit.plan.neuron_releases import engine_requirements as release_requirements

SUITE = "bookworm"  # the test hosts' codename: the role points apt at <repository> <codename> main
NEURON_PACKAGES = ("aws-neuronx-dkms", "aws-neuronx-runtime-lib", "aws-neuronx-collectives", "aws-neuronx-tools")
# what the EFA installer stand-in installs (dpkg names of the real installer's Debian packages)
EFA_PACKAGES = ("libfabric1-aws", "libfabric-aws-bin")
EFA_KMOD_PACKAGE = "efa"
# the other system packages provisioning installs: the CUDA driver stub (setup guide) and hwloc
CUDA_STUB_PACKAGES = ("cuda-cudart-dev-12-6", "cuda-cudart-12-6")
CUDA_VERSION = "12.6.77"  # stand-in only: no source names the exact 12.6 patch release
HWLOC_PACKAGES = ("libhwloc15",)
# the manual's compiler (setup/pytorch/manual.rst: apt-get install python3.X-venv g++), Debian's real one
GXX_PACKAGES = ("g++",)
KERNEL = os.uname().release  # the test hosts share the controller's kernel (systemd-nspawn)
STANDIN_NOTE = "STAND-IN built by the epd-kit test harness: not AWS software, no driver, no kernel module"


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


# --- stub libraries -------------------------------------------------------------------------

# The symbols (and symbol versions) NIXL's libplugin_LIBFABRIC.so links from each library
# (`nm -D --undefined-only`: nixl 1.3.2 takes fi_getinfo/fi_freeinfo/fi_dupinfo at FABRIC_1.7,
# 1.5.1 at FABRIC_1.10; libfabric keeps the older versions of a symbol beside the newer, as the
# stub does); each stub returns the "nothing there" error of the real library.
STUBS = {
    "libfabric.so.1": (
        """#include <stddef.h>
/* STAND-IN libfabric: NIXL's ABI, no provider (a host without an EFA interface). */
int fi_getinfo(unsigned v, const char *n, const char *s, unsigned long long f, const void *h, void **i)
{ if (i) *i = NULL; return -61; }
void fi_freeinfo(void *i) {}
void *fi_dupinfo(const void *i) { return NULL; }
int fi_getinfo_1_7(unsigned v, const char *n, const char *s, unsigned long long f, const void *h, void **i)
{ if (i) *i = NULL; return -61; }
void fi_freeinfo_1_7(void *i) {}
void *fi_dupinfo_1_7(const void *i) { return NULL; }
__asm__(".symver fi_getinfo_1_7,fi_getinfo@FABRIC_1.7");
__asm__(".symver fi_freeinfo_1_7,fi_freeinfo@FABRIC_1.7");
__asm__(".symver fi_dupinfo_1_7,fi_dupinfo@FABRIC_1.7");
int fi_fabric(void *a, void **f, void *c) { return -61; }
const char *fi_strerror(int e) { return "No data available (STAND-IN libfabric: no provider)"; }
unsigned fi_version(void) { return (1u << 16) | 22u; }
""",
        "FABRIC_1.0 { global: fi_strerror; fi_version; local: *; };\\n"
        "FABRIC_1.1 { global: fi_fabric; } FABRIC_1.0;\\n"
        "FABRIC_1.7 { } FABRIC_1.1;\\n"
        "FABRIC_1.10 { global: fi_getinfo; fi_freeinfo; fi_dupinfo; } FABRIC_1.7;\\n",
    ),
    "libcuda.so.1": (
        """/* STAND-IN CUDA driver stub: every call answers CUDA_ERROR_STUB_LIBRARY (34). */
int cuInit(unsigned f) { return 34; }
int cuCtxSetCurrent(void *c) { return 34; }
int cuDeviceGetPCIBusId(char *b, int l, int d) { return 34; }
int cuPointerGetAttributes(unsigned n, void *a, void **d, unsigned long long p) { return 34; }
""",
        None,
    ),
    "libcudart.so.12": (
        """/* STAND-IN CUDA runtime: no device. */
const char *cudaGetErrorString(int e) { return "CUDA driver is a stub library"; }
int cudaSetDevice(int d) { return 34; }
""",
        "libcudart.so.12 { global: *; };\\n",
    ),
}


def build_stub(soname: str, target: Path, work: Path) -> None:
    source, version_script = STUBS[soname]
    c = work / f"{soname}.c"
    c.write_text(source)
    argv = ["gcc", "-shared", "-fPIC", "-O1", "-o", str(target), f"-Wl,-soname,{soname}", str(c)]
    if version_script:
        (work / f"{soname}.map").write_text(version_script.replace("\\n", "\n"))
        argv.append(f"-Wl,--version-script={work / f'{soname}.map'}")
    target.parent.mkdir(parents=True, exist_ok=True)
    run(argv)


# --- debs -----------------------------------------------------------------------------------


@dataclass
class Deb:
    package: str
    version: str  # the full Debian version
    depends: str = ""
    files: dict[str, Path | str] | None = None  # path in the package -> a built file or text
    postinst: str = ""
    description: str = ""
    architecture: str = "amd64"


def build_deb(pool: Path, deb: Deb, work: Path) -> Path:
    out = pool / f"{deb.package}_{deb.version}_{deb.architecture}.deb"
    if out.exists():
        return out
    root = work / f"deb-{deb.package}_{deb.version}"
    doc = root / "usr/share/doc" / deb.package
    doc.mkdir(parents=True)
    (doc / "STAND-IN").write_text(f"{deb.package} {deb.version}\n{STANDIN_NOTE}\n")
    for path, content in (deb.files or {}).items():
        dest = root / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copy2(content, dest)
        else:
            dest.write_text(content)
            dest.chmod(0o755 if content.startswith("#!") else 0o644)
    (root / "DEBIAN").mkdir()
    depends = f"Depends: {deb.depends}\n" if deb.depends else ""
    (root / "DEBIAN/control").write_text(
        f"Package: {deb.package}\nVersion: {deb.version}\nArchitecture: {deb.architecture}\n{depends}"
        "Maintainer: epd-kit test harness <nobody@invalid>\nSection: misc\nPriority: optional\n"
        f"Description: STAND-IN for {deb.description or deb.package} (epd-kit tests only)\n {STANDIN_NOTE}.\n"
    )
    if deb.postinst:
        (root / "DEBIAN/postinst").write_text(deb.postinst)
        (root / "DEBIAN/postinst").chmod(0o755)
    run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(out)])
    return out


# dkms builds the module against the running kernel's headers and fails without them
DKMS_POSTINST = """#!/bin/sh
set -e
[ "$1" = configure ] || exit 0
kernel=$(uname -r)
if [ ! -e "/usr/src/linux-headers-$kernel/STAND-IN" ] && [ ! -d "/lib/modules/$kernel/build" ]; then
  echo "Error! Your kernel headers for kernel $kernel cannot be found." >&2
  echo "Please install the linux-headers-$kernel package (dkms cannot build the neuron module)." >&2
  exit 1
fi
echo "aws-neuronx-dkms (STAND-IN): no module built; kernel headers of $kernel present"
"""


def neuron_debs() -> list[Deb]:
    debs = []
    for release in RELEASES.values():
        for package, version in release.neuron.items():
            postinst = DKMS_POSTINST if package == "aws-neuronx-dkms" else ""
            debs.append(Deb(package, f"{version}-{DEB_REVISION}", postinst=postinst, description=f"AWS {package}"))
    headers = f"/usr/src/linux-headers-{KERNEL}/STAND-IN"
    debs.append(Deb(f"linux-headers-{KERNEL}", f"1-{DEB_REVISION}", files={headers: STANDIN_NOTE + "\n"}))
    return debs


def cuda_debs(work: Path) -> list[Deb]:
    base = "/usr/local/cuda-12.6/targets/x86_64-linux/lib"
    build_stub("libcuda.so.1", work / "stubs/libcuda.so", work)
    build_stub("libcudart.so.12", work / "stubs/libcudart.so.12", work)
    version = f"{CUDA_VERSION}-1"
    return [
        Deb("cuda-cudart-12-6", version, files={f"{base}/libcudart.so.12": work / "stubs/libcudart.so.12"}),
        Deb(
            "cuda-cudart-dev-12-6",
            version,
            depends=f"cuda-cudart-12-6 (= {version})",
            files={f"{base}/stubs/libcuda.so": work / "stubs/libcuda.so"},
        ),
    ]


# NVIDIA's CUDA repository as the vllm-neuron setup guide reaches it: a cuda-keyring package whose
# sources list names the repository and its key (signed-by); here a flat repository ("<url> /")
# beside the keyring package, signed with a throwaway key. No source read shows the real
# package's files: the role reads whatever sources list and keyring the package holds.
CUDA_KEYRING_DEB = "cuda-keyring_1.0-1_all.deb"
CUDA_KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"


def build_cuda_repository(target: Path, work: Path, server: str) -> None:
    target.mkdir(parents=True)
    for deb in cuda_debs(work):
        build_deb(target, deb, work)
    run(["sh", "-c", "dpkg-scanpackages --multiversion . /dev/null > Packages"], cwd=target)
    (target / "Release").write_text(release_file(target, "CUDA repository", suite=None))
    gpg = signing_key(work, "cuda", "epd-kit STAND-IN CUDA repository (tests only)")
    run([*gpg, "--clearsign", "--output", str(target / "InRelease"), str(target / "Release")])
    (work / "cuda-archive-keyring.gpg").write_bytes(
        subprocess.run([*gpg, "--export"], capture_output=True, check=True).stdout
    )
    keyring = Deb(
        "cuda-keyring",
        "1.0-1",
        files={
            CUDA_KEYRING: work / "cuda-archive-keyring.gpg",
            "/etc/apt/sources.list.d/cuda-standin.list": f"deb [signed-by={CUDA_KEYRING}] {server}/cuda/ /\n",
        },
        description="NVIDIA's cuda-keyring (the CUDA repository's sources list and key)",
        architecture="all",
    )
    shutil.copy2(build_deb(work, keyring, work), target.parent / CUDA_KEYRING_DEB)
    # the same package with another key (the mistake: a keyring that did not sign the repository)
    other = signing_key(work, "cuda-other", "epd-kit STAND-IN not the CUDA key (tests only)")
    (work / "other-keyring.gpg").write_bytes(
        subprocess.run([*other, "--export"], capture_output=True, check=True).stdout
    )
    wrong = Deb(
        **{
            **asdict(keyring),
            "version": "1.0-1wrong",
            "files": {**keyring.files, CUDA_KEYRING: work / "other-keyring.gpg"},
        }
    )
    shutil.copy2(build_deb(work, wrong, work), target.parent / "cuda-keyring-wrong-key.deb")


def release_file(dists: Path, label: str = "Neuron repository", suite: str | None = SUITE) -> str:
    lines = [
        "Origin: epd-kit-standin",
        f"Label: STAND-IN {label} (epd-kit tests)",
        *([f"Suite: {suite}", f"Codename: {suite}"] if suite else []),
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


def build_apt_repository(target: Path, work: Path, bare_rootfs: Path) -> None:
    """The Neuron packages, the kernel headers, Debian's hwloc and g++ in one signed repository."""
    pool = target / "pool"
    pool.mkdir(parents=True)
    for deb in neuron_debs():
        build_deb(pool, deb, work)
    run(["apt-get", "download", *missing_from(bare_rootfs, HWLOC_PACKAGES + GXX_PACKAGES)], cwd=pool)
    dists = target / "dists" / SUITE
    binary = dists / "main/binary-amd64"
    binary.mkdir(parents=True)
    packages = run(["dpkg-scanpackages", "--multiversion", "pool", "/dev/null"], cwd=target).stdout
    (binary / "Packages").write_text(packages)
    (dists / "Release").write_text(release_file(dists))
    # a throwaway signing key, like the repository's own; apt on the hosts checks the signature
    gpg = signing_key(work, "apt", "epd-kit STAND-IN Neuron repository (tests only)")
    run([*gpg, "--clearsign", "--output", str(dists / "InRelease"), str(dists / "Release")])
    run([*gpg, "--armor", "--detach-sign", "--output", str(dists / "Release.gpg"), str(dists / "Release")])
    (target / "GPG-PUB-KEY-EPD-STANDIN.PUB").write_text(run([*gpg, "--armor", "--export"]).stdout)


# --- EFA installer ----------------------------------------------------------------------------

# efa_installer.sh's options and behaviour (its usage text and install_efa_packages): --minimal
# skips libfabric, openmpi and efa-profile; --skip-kmod skips the kernel module and its headers;
# the kernel module needs the running kernel's headers (exit_kernel_hdr_not_installed).
INSTALLER = r"""#!/bin/bash
# {note}
# Takes the real efa_installer.sh's options and installs like it, from the bundled packages.
set -uo pipefail
cd "$(dirname "$0")"
usage() {{
  cat <<EOF
usage: $(basename "$0") [options]
 -d, --debug-packages, -u, --uninstall, -y, --yes, -n, --no-verify, -l, --skip-limit-conf,
 -k, --skip-kmod, -g, --enable-gdr,
 -m, --minimal          Only install kernel module and rdma-core, do not install openmpi and libfabric
EOF
}}
long=debug-packages,no-verify,uninstall,yes,skip-limit-conf,skip-kmod,minimal,enable-gdr
TEMP=$(getopt -o :dnuylkmg --long "$long" -- "$@") || {{ usage; exit 1; }}
eval set -- "$TEMP"
SKIP_KMOD=0 MINIMAL=0 UNATTENDED=0
while true; do
  case "$1" in
    -k|--skip-kmod) SKIP_KMOD=1; shift ;;
    -m|--minimal) MINIMAL=1; shift ;;
    -y|--yes) UNATTENDED=1; shift ;;
    -u|--uninstall) echo "efa_installer.sh (stand-in): --uninstall is not part of the stand-in" >&2; exit 2 ;;
    -d|--debug-packages|-n|--no-verify|-l|--skip-limit-conf|-g|--enable-gdr) shift ;;
    --) shift; break ;;
    *) usage; exit 1 ;;
  esac
done
[ "$UNATTENDED" -eq 1 ] || {{ echo "efa_installer.sh (stand-in): run with --yes (no prompt here)" >&2; exit 1; }}
echo "= Starting Amazon Elastic Fabric Adapter Installation Script ="
echo "= EFA Installer Version: {version} ="
packages=()
if [ "$SKIP_KMOD" -eq 0 ]; then
  echo "== Installing EFA dependencies =="
  if ! apt-get install -y "linux-headers-$(uname -r)"; then
    cat >&2 <<EOF
The kernel header of the current kernel version cannot be installed and is required
to build the EFA kernel module. Please install the kernel header package for your
distribution manually or build the EFA kernel driver manually and re-run the installer
with --skip-kmod.
EOF
    exit 1
  fi
  packages+=(./DEBS/{kmod}_*.deb)
fi
if [ "$MINIMAL" -eq 1 ]; then
  for deb in ./DEBS/libfabric*.deb; do echo "skipping $(basename "$deb" .deb) because of minimal installation"; done
else
  packages+=(./DEBS/libfabric*.deb)
fi
echo "== Installing EFA packages =="
# like package_should_be_skipped: a package the host has at this version or newer is kept
install=()
for deb in "${{packages[@]}}"; do
  name=$(dpkg-deb -f "$deb" Package) version=$(dpkg-deb -f "$deb" Version)
  have=$(dpkg-query -W -f '${{Version}}' "$name" 2>/dev/null || true)
  if [ -n "$have" ] && dpkg --compare-versions "$version" le "$have"; then
    echo "${{name}}_$have already installed"
  else
    install+=("$deb")
  fi
done
packages_all=("${{packages[@]}}")
packages=("${{install[@]}}")
if [ ${{#packages[@]}} -gt 0 ]; then
  apt-get install -y --no-install-recommends "${{packages[@]}}" ||
    {{ echo "Error: failed to install EFA packages, exiting" >&2; exit 1; }}
fi
mkdir -p /opt/amazon
{{
  echo "# EFA installer version: {version}"
  echo "# Debug packages installed: no"
  echo "# Packages installed:"
  for deb in "${{packages_all[@]}}"; do basename "$deb" .deb; done | tr '\n' ' '; echo
}} > /opt/amazon/efa_installed_packages
echo "==================================================="
echo "EFA installation complete."
echo "- Please logout/login to complete the installation."
[ "$MINIMAL" -eq 1 ] || echo "- Libfabric was installed in /opt/amazon/efa"
echo "==================================================="
"""

# `fi_info -p efa` on a host without an EFA provider: libfabric's error, exit 1
FI_INFO = """#!/bin/sh
# STAND-IN fi_info: the stand-in libfabric has no provider
echo "fi_getinfo: -61 (No data available)" >&2
exit 1
"""


def efa_debs(work: Path, version: str) -> list[Deb]:
    build_stub("libfabric.so.1", work / "stubs/libfabric.so.1", work)
    deb_version = f"{version}amzn1.0-{DEB_REVISION}"
    return [
        Deb("libfabric1-aws", deb_version, files={"/opt/amazon/efa/lib/libfabric.so.1": work / "stubs/libfabric.so.1"}),
        Deb(
            "libfabric-aws-bin",
            deb_version,
            depends=f"libfabric1-aws (= {deb_version})",
            files={"/opt/amazon/efa/bin/fi_info": FI_INFO},
        ),
        Deb(EFA_KMOD_PACKAGE, deb_version, description="the EFA kernel module (nothing is built)"),
    ]


def missing_from(rootfs: Path, packages: tuple[str, ...]) -> list[str]:
    """What apt would install on that rootfs for these packages (the packages and their missing
    dependencies): a simulation against the rootfs's dpkg status."""
    argv = ["apt-get", "--simulate", "-o", f"Dir::State::status={rootfs / 'var/lib/dpkg/status'}"]
    out = run([*argv, "install", "--no-install-recommends", *packages]).stdout
    return [line.split()[1] for line in out.splitlines() if line.startswith("Inst ")]


def build_efa_installers(target: Path, work: Path) -> str:
    """One tarball per release, each signed like AWS's (<tarball>.sig, key aws-efa-installer.key):
    returns the signing key's fingerprint."""
    target.mkdir(parents=True)
    gpg = signing_key(work, "efa", "epd-kit STAND-IN EFA installer (tests only)")
    for release in RELEASES.values():
        version = release.efa_installer
        tree = work / f"efa-{version}" / "aws-efa-installer"
        (tree / "DEBS").mkdir(parents=True)
        for deb in efa_debs(work, version):
            build_deb(tree / "DEBS", deb, work)
        script = tree / "efa_installer.sh"
        script.write_text(INSTALLER.format(note=STANDIN_NOTE, version=version, kmod=EFA_KMOD_PACKAGE))
        script.chmod(0o755)
        (tree / "README.STAND-IN").write_text(STANDIN_NOTE + "\n")
        tarball = target / f"aws-efa-installer-{version}.tar.gz"
        with tarfile.open(tarball, "w:gz") as archive:
            archive.add(tree, arcname="aws-efa-installer")
        digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
        (target / f"{tarball.name}.sha256").write_text(f"{digest}  {tarball.name}\n")
        run([*gpg, "--detach-sign", "--output", f"{tarball}.sig", str(tarball)])
    (target / "aws-efa-installer.key").write_text(run([*gpg, "--armor", "--export"]).stdout)
    return key_fingerprint(gpg)


def signing_key(work: Path, name: str, uid: str) -> list[str]:
    """A throwaway signing key in a GnuPG home of its own: the gpg argv that signs with it."""
    gnupg = work / f"gnupg-{name}"
    gnupg.mkdir(mode=0o700)
    gpg = ["gpg", "--homedir", str(gnupg), "--batch", "--quiet", "--pinentry-mode", "loopback", "--passphrase", ""]
    run([*gpg, "--quick-gen-key", uid, "ed25519", "sign", "never"])
    return gpg


def key_fingerprint(gpg: list[str]) -> str:
    out = run([*gpg, "--with-colons", "--list-keys"]).stdout
    return next(line.split(":")[9] for line in out.splitlines() if line.startswith("fpr:"))


# --- pip stand-ins ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Standin:
    """A stand-in distribution: its import name, console script, and the Requires-Dist lines it
    declares, copied from the real package (`source`). Only the lines that name the torch family,
    the Neuron packages and NIXL are carried: those are the pins that can conflict, and each one
    names a wheel the sandbox has (a stand-in, or a real wheel from PyPI in REAL_WHEELS). The
    real packages' other requirements (transformers, fastapi, ... for vllm) are left out."""

    module: str
    script: str | None
    requires: tuple[str, ...]
    source: str
    files: tuple[tuple[str, str], ...] = ()  # extra (path, text) files of the real package's layout
    init: str = ""  # more of <module>/__init__.py: names the real package's importers use
    # the tag the real wheel is published with (the comment on each entry names where it was read);
    # {cp} is the test hosts' CPython tag. A linux_x86_64 or manylinux tag makes pip on the
    # controller refuse the stand-in where it would refuse the real wheel for the hosts.
    tag: str = "py3-none-any"


PIP_STANDINS: dict[str, Standin] = {
    "vllm": Standin(
        "vllm",
        "vllm",
        ("torch==2.11.0", "torchaudio==2.11.0", "torchvision==0.26.0"),
        "vllm 0.24.0 METADATA (PyPI wheel), its torch-family lines",
        # PyPI's file list, as public listings copy it: vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
        tag="cp38-abi3-manylinux_2_28_x86_64",
    ),
    "vllm-neuron": Standin(
        "vllm_neuron",
        None,
        ("libtorch-neuronx-lite", "vllm==0.24.0", "nixl==1.3.2"),
        "vllm-neuron 0.24.0.1.1.0 requirements/core.txt (pyproject.toml: dependencies from it)",
        # v2.32.0 release-notes/releasecontent: vllm_neuron-0.24.0.1.1.0+e8242a9-py3-none-any.whl
        tag="py3-none-any",
    ),
    "libtorch-neuronx-lite": Standin(
        "libtorch_neuronx_lite",
        None,
        ("protobuf", "psutil", "torch", "torch-xla"),
        "libtorch-neuronx-lite 2.11.0.1.0.1284 `pip show`: Requires: protobuf, psutil, torch, torch-xla",
    ),
    # third-party reports of the Neuron pip repository's files (it is out of reach here):
    # .../neuronx-cc/neuronx_cc-2.24.8799.0%2B6f62ff7c-cp310-cp310-linux_x86_64.whl,
    # nki-0.4.0b4-cp312-cp312-linux_x86_64.whl, nki-0.3.0+...-cp311-cp311-linux_x86_64
    "neuronx-cc": Standin(
        "neuronxcc",
        "neuronx-cc",
        (),
        "METADATA not read (Neuron pip repository out of reach)",
        tag="{cp}-{cp}-linux_x86_64",
    ),
    "nki": Standin(
        "nki", None, (), "METADATA not read (Neuron pip repository out of reach)", tag="{cp}-{cp}-linux_x86_64"
    ),
    # PyTorch's own cu126 build shape (torch.version.cuda "12.6"): nixl then loads nixl_cu12, whose
    # CUDA 12 libraries the sandbox's cuda-cudart-12-6 stand-in provides. PyPI's torch 2.11.0 is a
    # CUDA 13 build (its METADATA: cuda-toolkit[...]==13.0.2); that shape is tested without hosts
    # (tests/ansible/test_transfer_probe.py). Its CUDA runtime requirements are not carried.
    "torch": Standin(
        "torch",
        None,
        (),
        "torch 2.11.0 METADATA: only CUDA/triton requirements, not carried",
        (("torch/version.py", '__version__ = "{version}"\ncuda = "12.6"\n'),),
        # nixl 1.3.2's nixl_cu12/_api.py imports torch and annotates with torch.Tensor at import
        "from . import version\n\n\nclass Tensor:\n    pass\n",
        # pip's own log of PyPI: "Downloading torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl.metadata"
        tag="{cp}-{cp}-manylinux_2_28_x86_64",
    ),
    "torchaudio": Standin("torchaudio", None, (), "requirements not carried"),
    "torchvision": Standin("torchvision", None, (), "requirements not carried"),
    "torch-xla": Standin("torch_xla", None, (), "requirements not carried"),
    # the Neuron 2.31 PyTorch 2.9 framework (manual.rst: "PyTorch 2.9.0"): the exact specifier of
    # its torch requirement was not read; 2.9 is the family it is built for
    "torch-neuronx": Standin("torch_neuronx", None, ("torch<2.10,>=2.9",), "torch 2.9 family (manual.rst)"),
}
# versions of the stand-ins that no release pins directly: what the pins' requirements ask for,
# and the torch of the 2.9 framework (so the old requirement set fails on a real version conflict)
LEAF_VERSIONS = {
    "torch": ("2.11.0", "2.9.1"),
    "torchaudio": ("2.11.0",),
    "torchvision": ("0.26.0",),
    "torch-xla": ("2.11.0",),
    "torch-neuronx": ("2.9.0.2.15.32035",),
}
# real wheels from PyPI the stand-ins' requirements name, for the test hosts' Python 3.11
REAL_WHEELS = (
    "nixl==1.3.2",
    "nixl-cu12==1.3.2",
    "nixl-cu13==1.3.2",
    "numpy==2.4.6",
    "protobuf==7.36.2",
    "psutil==7.2.2",
)
# the nixl the kit pinned before (1.5.1, its meta package only): the old requirement set must fail
# on the conflict with vllm-neuron's nixl==1.3.2, not on a missing wheel
OLD_WHEELS = ("nixl==1.5.1",)
HOST_PYTHON, HOST_MACHINE, HOST_GLIBC = "3.11", "x86_64", "2.36"  # the test hosts: Debian 12


@dataclass(frozen=True)
class Release:
    """One set of pins, as the role's variables take them."""

    neuron: dict[str, str]  # apt package -> upstream version (the role pins <version>*)
    efa_installer: str
    engine_venv: dict[str, str]  # epd_provision_engine_pins: pip distribution -> version

    @property
    def vllm_neuron(self) -> str:
        return self.engine_venv["vllm-neuron"]


def standin_pins(engine_venv: dict[str, str]) -> dict[str, str]:
    """A release's engine venv with each stand-in's local label (real wheels, e.g. nixl, keep theirs)."""
    return {dist: f"{version}+standin" if dist in PIP_STANDINS else version for dist, version in engine_venv.items()}


# A: the release the role installs by default (epd_kit.plan.neuron_releases, whose table names
# the source of each pin); B: newer stand-in versions, for the upgrade, rollback and newer-host tests.
_DEFAULT = neuron_release(DEFAULT_RELEASE)
RELEASE_A = Release(
    neuron=dict(_DEFAULT.profile()["system"]),
    efa_installer=_DEFAULT.efa_installer.version,
    engine_venv=standin_pins(_DEFAULT.profile()["engine_venv"]),
)
RELEASE_B = Release(
    neuron={
        "aws-neuronx-dkms": "2.30.3.0",
        "aws-neuronx-runtime-lib": "2.34.11.0",
        "aws-neuronx-collectives": "2.34.11.0",
        "aws-neuronx-tools": "2.32.29.0",
    },
    efa_installer="1.47.1",
    engine_venv=RELEASE_A.engine_venv | {"vllm-neuron": "0.24.0.1.2.0+standin"},
)
RELEASES = {"a": RELEASE_A, "b": RELEASE_B}


def build_wheel(target: Path, dist: str, version: str, standin: Standin) -> None:
    """A stand-in wheel (Python files only): <module>/__init__.py that says it is a stand-in, the
    real package's Requires-Dist lines (+ a console script that fails, + the extra files), tagged as the real one."""
    stem = f"{dist.replace('-', '_')}-{version}"
    tag = standin.tag.format(cp="cp" + HOST_PYTHON.replace(".", ""))
    requires = "".join(f"Requires-Dist: {line}\n" for line in standin.requires)
    files = {
        f"{standin.module}/__init__.py": f'"""{STANDIN_NOTE}."""\n\n__version__ = "{version}"\nSTANDIN = True\n\n\n'
        "def main() -> int:\n"
        f'    print("{dist} {version}: {STANDIN_NOTE}")\n'
        "    return 1\n" + (f"\n\n{standin.init}" if standin.init else ""),
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        f"Summary: STAND-IN for {dist} (epd-kit tests only); Requires-Dist from {standin.source}\n{requires}",
        f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: epd-kit-standins\n"
        f"Root-Is-Purelib: {str(tag == 'py3-none-any').lower()}\nTag: {tag}\n",
    }
    files.update({path: text.format(version=version) for path, text in standin.files})
    if standin.script:
        files[f"{stem}.dist-info/entry_points.txt"] = f"[console_scripts]\n{standin.script} = {standin.module}:main\n"
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{stem}.dist-info/RECORD,,")
    files[f"{stem}.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(target / f"{stem}-{tag}.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


def build_pip_standins(target: Path) -> None:
    target.mkdir(parents=True)
    wanted = {(dist, version) for release in RELEASES.values() for dist, version in release.engine_venv.items()}
    wanted |= {(dist, f"{v}+standin") for dist, versions in LEAF_VERSIONS.items() for v in versions}
    for dist, version in sorted(wanted):
        if dist in PIP_STANDINS:
            build_wheel(target, dist, version, PIP_STANDINS[dist])
    download_real_wheels(target)


def download_real_wheels(target: Path) -> None:
    """The real wheels the stand-ins' requirements name (NIXL, numpy, ...), for the test hosts."""
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--quiet", "--no-deps"]
    argv += ["--only-binary", ":all:", "--dest", str(target), "--python-version", HOST_PYTHON]
    argv += ["--implementation", "cp", "--abi", "cp" + HOST_PYTHON.replace(".", "")]
    for tag in ("manylinux_2_28", "manylinux_2_17", "manylinux2014", "manylinux_2_12", "manylinux2010"):
        argv += ["--platform", f"{tag}_{HOST_MACHINE}"]
    for wheels in (REAL_WHEELS, OLD_WHEELS):  # one pip run cannot take two versions of one project
        run(argv + list(wheels))


# --- the role's variables for the stand-ins -----------------------------------------------------------

# the role's override variable of each Neuron package (epd_provision_neuron_<name>_version)
NEURON_OVERRIDES = {
    "driver": "aws-neuronx-dkms",
    "runtime": "aws-neuronx-runtime-lib",
    "collectives": "aws-neuronx-collectives",
    "tools": "aws-neuronx-tools",
}
SERVER = "http://10.213.0.1:18780"  # the tests serve the stand-in directory at SERVER/standins, inside kithub only


def provision_vars(release_name: str, target: Path | None = None, server: str = SERVER) -> dict:
    """epd_provision_* for a release of the stand-ins served at `server` (the sandbox's pins).

    The engine venv is resolved by pip as on a real host: the index is an empty local directory
    (nothing is reachable from the test network) and every wheel comes from the stand-in
    directory, so a conflict between the pins' requirements fails the build here as it would there."""
    release = RELEASES[release_name]
    target = target or standin_dir()
    efa_tarball = f"aws-efa-installer-{release.efa_installer}.tar.gz"
    return {
        "epd_provision_neuron_apt_repository": f"{server}/apt",
        "epd_provision_neuron_apt_key_url": f"{server}/apt/GPG-PUB-KEY-EPD-STANDIN.PUB",
        "epd_provision_neuron_apt_suite": SUITE,
        # the release profile's pins hold for release A: an override only where B differs (a role
        # that read an unset override instead of the profile fails here as on a real host)
        **{
            f"epd_provision_neuron_{name}_version": release.neuron[package]
            for name, package in NEURON_OVERRIDES.items()
            if release.neuron[package] != RELEASE_A.neuron[package]
        },
        "epd_provision_neuron_check_devices": False,  # no Neuron device in a container
        "epd_provision_extra_os": ["Debian 12"],  # the test hosts' OS: no Neuron source lists it
        **(
            {"epd_provision_efa_installer_version": release.efa_installer}
            if release.efa_installer != RELEASE_A.efa_installer
            else {}
        ),
        "epd_provision_efa_installer_url": f"{server}/efa/{efa_tarball}",
        "epd_provision_efa_installer_key_url": f"{server}/efa/aws-efa-installer.key",
        "epd_provision_efa_installer_key_fingerprint": manifest(target)["efa_key_fingerprint"],
        "epd_provision_efa_check_provider": False,  # the stand-in libfabric has no provider (no EFA device either)
        "epd_provision_cuda_keyring_url": f"{server}/{CUDA_KEYRING_DEB}",
        "epd_provision_engine_pins": dict(release.engine_venv),
        "epd_provision_engine_resolve_dependencies": True,
        "epd_provision_engine_pip_index_url": f"file://{target / 'empty-index'}",
        "epd_provision_engine_pip_extra_index_urls": [],
        "epd_provision_engine_pip_find_links": [str(target / "pip")],
        "epd_engine_venv": "/opt/epd/engine-venv",
    }


def engine_requirements(variables: dict) -> list[str]:
    """The role's engine venv requirement set for these variables (the same function as vars/main.yml's)."""
    return release_requirements(
        variables.get("epd_neuron_release", DEFAULT_RELEASE),
        variables.get("epd_provision_engine_pins"),
        variables.get("epd_provision_engine_extra_requirements"),
    )


def engine_wheelhouse_argv(variables: dict) -> list[str]:
    """The role's build_engine_wheelhouse.py arguments for these variables and the test hosts'
    interpreter (validate.yml builds the same)."""
    defaults = {"epd_provision_engine_pip_index_url": "https://pypi.org/simple"}
    merged = {**defaults, **variables}
    argv = ["--index-url", merged["epd_provision_engine_pip_index_url"]]
    argv += ["--python-version", HOST_PYTHON, "--host-platform", f"{HOST_MACHINE}:{HOST_GLIBC}"]
    argv += [f"--requirement={r}" for r in engine_requirements(merged)]
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
        build_apt_repository(staging / "apt", work, rootfs)
        efa_key = build_efa_installers(staging / "efa", work)
        build_cuda_repository(staging / "cuda", work, f"{SERVER}/standins")
        build_pip_standins(staging / "pip")
        (staging / "empty-index").mkdir()  # the engine wheelhouse's package index: nothing (find-links has all)
        manifest = {
            "note": STANDIN_NOTE,
            "suite": SUITE,
            "releases": {name: asdict(release) for name, release in RELEASES.items()},
            "efa_key_fingerprint": efa_key,
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
