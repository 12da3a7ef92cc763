"""Pre-build the deps role's offline wheelhouse on the controller BEFORE entering the kithub
network namespace (which has no route to any package index).

`deploy.yml` builds the wheelhouse on the controller itself (roles/epd_deps), keyed by the
kit's sources, the pins and the Python version, and reuses a cached one. Inside kithub that
build cannot download anything, so scripts/test.sh and scripts/demo.sh call this first with
the same builder, cache and pins as the role (both pin sets: the sim backend's and the real
engines' none): the deploy then finds it cached.

    python tests/hosts/wheelhouse.py      prints the builder's JSON line
    python tests/hosts/wheelhouse.py kit         all but the provisioning stand-ins (no rootfs needed)
    python tests/hosts/wheelhouse.py standins    the stand-ins alone (they need the bare rootfs)

A fresh clone shares the machine's cache ($KIT_DIR/repo-cache, linked as .cache/): a second
checkout of the same sources finds its wheelhouse built.

It also builds the provisioning stand-ins (tests/hosts/standins/build.py: a local Neuron apt
repository, EFA installer tarballs, vllm/vllm-neuron stand-in wheels; they need the Debian
mirror once) and the engine wheelhouse of each stand-in release (NIXL from PyPI), for
tests/e2e/test_provision_hosts.py; tests/ansible/test_transfer_probe.py takes its NIXL wheels from
the same stand-in directory. And the trace store's wheelhouse (Phoenix, roles/epd_observability),
and the kit wheelhouse of the release before (PREVIOUS_RELEASE, which
tests/e2e/test_release_upgrade.py deploys from its own tree before this one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles/epd_deps"
BUILDER = ROLE / "files/build_wheelhouse.py"
CACHE = REPO / ".cache/wheelhouse"  # the role's default epd_deps_wheelhouse_cache
# main before issue 57's models-as-one-list (merge s8-nixl-3host): router.yaml in the old shape.
# tests/e2e/test_release_upgrade.py deploys it first, then this checkout over it.
PREVIOUS_RELEASE = "f3f3a81"
# its own cache: in the shared one, the builds of this run's other trees (test_router_ha's kit
# upgrade, the real engines' pins) pushed it out of the newest few before its test ran (a CI run)
PREVIOUS_CACHE = REPO / ".cache/wheelhouse-previous"


def sim_pins(role: Path = ROLE) -> list[str]:
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text())
    return list(defaults.get("epd_deps_sim_pins") or [])


def share_the_machines_cache() -> None:
    """A checkout without .cache/ (a fresh clone) uses the machine's: REPO/.cache becomes a link to
    $KIT_DIR/repo-cache, shared by every checkout here. Safe to share: each archive is named by
    a hash of what it holds, and each builder locks its cache while it builds."""
    link = REPO / ".cache"
    if link.exists() or link.is_symlink():
        return
    shared = Path(os.environ.get("KIT_DIR", "/var/tmp/epd-kit")) / "repo-cache"
    shared.mkdir(parents=True, exist_ok=True)
    link.symlink_to(shared, target_is_directory=True)
    print(f"wheelhouse: {link} -> {shared} (the wheelhouses of this machine's checkouts)")


def main(argv: list[str]) -> int:
    """Both parts, or the one named: scripts/test.sh builds the kit's part beside the test hosts'
    rootfs (both mostly downloads) and the stand-ins, which read the bare rootfs, after it."""
    parts = argv or ["kit", "standins"]
    if not set(parts) <= {"kit", "standins"}:
        print(f"usage: wheelhouse.py [kit] [standins] (got {' '.join(argv)})", file=sys.stderr)
        return 2
    share_the_machines_cache()
    if "kit" in parts:
        kit_rc = kit_wheelhouses()
        if kit_rc:
            return kit_rc
    return provisioning_standins() if "standins" in parts else 0


def kit_wheelhouses() -> int:
    """The kit's wheelhouses (this tree's, both pin sets; the release before's) and the trace store's."""
    if not BUILDER.exists():
        print(f"wheelhouse: {BUILDER.relative_to(REPO)} not in this checkout; nothing to pre-build")
        return 0
    previous_release()
    argv = [sys.executable, str(BUILDER), "--repo", str(REPO), "--cache", str(CACHE)]
    # the sim backend's (pinned NIXL) and the real engines' (none: vllm-cpu, neuron; roles/epd_deps
    # vars epd_deps_pins); they share the downloaded dependencies
    for pins in (sim_pins(), []):
        kit_rc = subprocess.run(argv + [f"--pin={pin}" for pin in pins], check=False).returncode
        if kit_rc:
            return kit_rc
    trace_store()
    return 0


def extract_previous_release(tree: Path) -> str | None:
    """PREVIOUS_RELEASE's tree into the directory `tree`, from this clone's history (git archive: no
    worktree added); None when done, else why not (a clone without that commit)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE], capture_output=True, timeout=120, check=False
    )
    if archive.returncode != 0:
        return f"{PREVIOUS_RELEASE} is not in this clone's history ({archive.stderr.decode()[-300:]})"
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=120)
    return None


def previous_release() -> None:
    """The kit wheelhouse of PREVIOUS_RELEASE's tree (its own builder, its sim pins: the sandbox
    inventory that test deploys is the sim's) in PREVIOUS_CACHE, which that test's deploy of
    the old tree names (epd_deps_wheelhouse_cache): inside kithub no index answers. A clone
    without that commit only warns (the test then skips, saying so)."""
    with tempfile.TemporaryDirectory(prefix="epd-previous-release-") as tmp:
        tree = Path(tmp)
        missing = extract_previous_release(tree)
        if missing:
            print(f"wheelhouse: WARNING: {missing}; no wheelhouse for it")
            return
        role = tree / "roles/epd_deps"
        argv = [
            sys.executable,
            str(role / "files/build_wheelhouse.py"),
            *("--repo", str(tree), "--cache", str(PREVIOUS_CACHE)),
        ]
        if subprocess.run(argv + [f"--pin={pin}" for pin in sim_pins(role)], check=False).returncode:
            print(
                f"wheelhouse: WARNING: no wheelhouse for {PREVIOUS_RELEASE}: test_release_upgrade's first deploy fails"
            )


def trace_store() -> None:
    """The trace store's wheelhouse (roles/epd_observability tasks/trace_store.yml: the same builder,
    requirement and cache), for tests/e2e/test_one_host.py's Phoenix on n1. A failure only warns:
    only a deploy that runs the trace store needs it, and that deploy then fails saying so."""
    role_vars = yaml.safe_load((REPO / "roles/epd_observability/vars/main.yml").read_text())
    builder = REPO / "roles/epd_common/files/build_engine_wheelhouse.py"
    argv = [sys.executable, str(builder), "--cache", str(REPO / ".cache/engine-wheelhouse")]
    argv += ["--requirement", role_vars["epd_observability_trace_store_requirement"], "--no-configured-find-links"]
    if subprocess.run(argv, check=False).returncode:
        print("wheelhouse: WARNING: no trace store wheelhouse; a deploy that runs the trace store will fail")


def provisioning_standins() -> int:
    """The stand-ins and one engine wheelhouse per stand-in release (the role's builder and cache).

    A failure here only warns: the deploy does not need them, and tests/e2e/test_provision_hosts.py
    fails with the reason when they are missing."""
    sys.path.insert(0, str(REPO))
    from tests.hosts.standins import build as standins

    try:
        target = standins.ensure()
    except SystemExit as error:
        print(
            f"wheelhouse: WARNING: no provisioning stand-ins ({error}); tests/e2e/test_provision_hosts.py will fail, "
            "tests/ansible/test_transfer_probe.py will skip"
        )
        return 0
    builder = REPO / "roles/epd_common/files/build_engine_wheelhouse.py"
    cache = REPO / ".cache/engine-wheelhouse"  # the role's default epd_provision_engine_wheelhouse_cache
    for release in standins.RELEASES:
        argv = [sys.executable, str(builder), "--cache", str(cache)]
        argv += standins.engine_wheelhouse_argv(standins.provision_vars(release, target))
        rc = subprocess.run(argv, check=False).returncode
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
