"""playbooks/provision.yml on real test hosts, against the stand-ins of tests/hosts/standins.

A bare host (rootfs variant without libfabric) gets the stand-in libfabric (NIXL's ABI, no
provider) under /opt/amazon/efa through the EFA installer stand-in, NIXL's real wheels through
the engine wheelhouse, the CUDA driver stub, Debian's hwloc and stand-in Neuron packages from a
signed local apt repository; NIXL's real LIBFABRIC plugin then loads (the provision probe's ldd
scan), and the sim stack deploys on it. A DLAMI-like host newer than the pins is left alone.
The stand-ins are served over http from 10.213.0.1, the hub bridge:
inside kithub, nothing else can reach them. Tests run in file order on one bare host.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hosts.harness import (
    REPO,
    HostPool,
    PlaybookResult,
    TestHost,
    ansible_playbook,
    run,
    write_inventory,
)
from tests.hosts.standins import build as standins

pytestmark = pytest.mark.systemd

PROVISION = "playbooks/provision.yml"
BARE, DLAMI = 4, 5  # n4 boots on the bare rootfs, n5 on the default (DLAMI-like) one
ENGINE_VENV = "/opt/epd/engine-venv"
ENGINE_VENVS = "/opt/epd/engine-venvs"
DLAMI_VENV = "/opt/aws_neuronx_venv_pytorch_inference_vllm_0_24"
# what provisioning writes on a host: a failed validation must leave every one of them absent
PROVISIONED = (
    "/etc/apt/sources.list.d/epd-neuron.list",
    "/etc/apt/keyrings/epd-neuron.asc",
    "/opt/amazon",
    ENGINE_VENVS,
    ENGINE_VENV,
)


@pytest.fixture(scope="module")
def standin_dir() -> Path:
    target = standins.standin_dir()
    if not (target / "manifest.json").exists():
        pytest.fail(
            f"no provisioning stand-ins at {target}: scripts/test.sh builds them before entering kithub "
            "(tests/hosts/wheelhouse.py; they need the Debian mirror once)",
            pytrace=False,
        )
    return target


@pytest.fixture(scope="module")
def server(standin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The stand-ins (+ release A's engine wheels, for the DLAMI-like image) over http on the hub bridge."""
    root = tmp_path_factory.mktemp("served")
    (root / "standins").symlink_to(standin_dir)
    wheels = root / "wheels"
    wheels.mkdir()
    with tarfile.open(engine_wheelhouse("a", standin_dir)) as archive:
        archive.extractall(wheels, filter="data")
    host, port = standins.SERVER.removeprefix("http://").split(":")
    process = subprocess.Popen(
        [sys.executable, "-m", "http.server", port, "--bind", host, "--directory", str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    pytest.fail(f"the stand-in server on {standins.SERVER} did not start", pytrace=False)
                time.sleep(0.1)
        yield f"{standins.SERVER}/standins"
    finally:
        process.terminate()
        process.wait(timeout=10)


def engine_wheelhouse(release: str, standin_dir: Path) -> Path:
    """The engine wheelhouse archive tests/hosts/wheelhouse.py pre-built for a release."""
    argv = [sys.executable, str(REPO / "roles/epd_common/files/build_engine_wheelhouse.py")]
    argv += ["--cache", str(REPO / ".cache/engine-wheelhouse"), "--dry-run"]
    argv += standins.engine_wheelhouse_argv(standins.provision_vars(release, standin_dir))
    built = json.loads(run(argv).stdout)
    if built["changed"]:
        pytest.fail(
            f"engine wheelhouse of release {release} not pre-built: run tests/hosts/wheelhouse.py", pytrace=False
        )
    return Path(built["archive"])


def inventory_for(host: TestHost, directory: Path) -> Path:
    engine = {"ansible_host": host.address, "epd_num_ve": 1, "epd_num_pd": 1, "epd_core_count": 12}
    hosts_yml = {
        "all": {
            "children": {
                "epd_engines": {"hosts": {host.name: engine}},
                "epd_router": {"hosts": {host.name: {"epd_router_listen_host": host.address}}},
                "epd_monitoring": {"hosts": {}},
            }
        }
    }
    return write_inventory(directory, REPO / "inventory/sandbox/one-host", hosts_yml)


def playbook(inventory: Path, book: str, variables: dict, *args: str) -> PlaybookResult:
    """ansible-playbook with these variables as extra vars (they win over the inventory). The file
    lives beside the inventory directory, not in it: Ansible would read it as an inventory source."""
    extra = inventory.parent / f"vars-{time.monotonic_ns()}.json"
    extra.write_text(json.dumps(variables))
    return ansible_playbook(inventory, book, "-e", f"@{extra}", *args)


def provision(inventory: Path, variables: dict, *args: str) -> PlaybookResult:
    return playbook(inventory, PROVISION, variables, *args)


def pins(release: str, server: str, **overrides) -> dict:
    return {**standins.provision_vars(release, server=server), **overrides}


def installed(host: TestHost) -> dict[str, str]:
    """dpkg package -> version of what provisioning installs."""
    out = host.run("dpkg-query -W -f '${Package} ${Version} ${db:Status-Status}\\n' 2>/dev/null; true").stdout
    wanted = set(standins.NEURON_PACKAGES) | set(standins.EFA_PACKAGES)
    return {
        p: v
        for p, v, s in (line.split() for line in out.splitlines() if line.count(" ") == 2)
        if p in wanted and s == "installed"
    }


def engine_versions(host: TestHost, names: tuple[str, ...], venv: str = ENGINE_VENV) -> dict[str, str]:
    script = f"from importlib import metadata as m; print(*(m.version(d) for d in {names}))"
    return dict(zip(names, host.run(f'{venv}/bin/python -c "{script}"').stdout.split(), strict=True))


def assert_untouched(host: TestHost) -> None:
    present = host.run(f"ls -d {' '.join(PROVISIONED)} /tmp/epd-provision.* 2>/dev/null; true").stdout.split()
    assert present == [], f"a failed validation left {present} on {host.name}"
    assert installed(host) == {}, f"a failed validation installed packages on {host.name}"


def assert_release(host: TestHost, release: str) -> None:
    expected = standins.RELEASES[release]
    versions = installed(host)
    for package, version in expected.neuron.items():
        assert versions.get(package) == f"{version}-{standins.DEB_REVISION}", versions
    record = host.run("cat /opt/amazon/efa_installed_packages").stdout
    assert f"EFA installer version: {expected.efa_installer}" in record
    assert engine_versions(host, tuple(expected.engine_venv)) == expected.engine_venv


@pytest.fixture(scope="module")
def bare(host_pool: HostPool, server: str) -> TestHost:
    # the kit preinstalled as on every stack but test_one_host's: the last test's deploy then skips
    # the kit install it would repeat byte for byte (provisioning never touches the kit's venv)
    return host_pool.up(BARE, variant="bare", kit=True)[0]


@pytest.fixture(scope="module")
def bare_inventory(bare: TestHost, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return inventory_for(bare, tmp_path_factory.mktemp("inventory-bare"))


def test_the_bare_host_has_no_libfabric(bare):
    assert "libfabric.so.1" not in bare.run("ldconfig -p").stdout
    assert_untouched(bare)


def test_a_wrong_efa_checksum_fails_before_anything_is_installed(bare, bare_inventory, server):
    result = provision(bare_inventory, pins("a", server, epd_provision_efa_installer_sha256="0" * 64))
    assert result.returncode != 0, result.describe()
    assert "expected " + "0" * 64 in result.stdout and "Nothing was installed" in result.stdout, result.describe()
    assert_untouched(bare)


def test_an_efa_installer_not_signed_by_the_key_fails_before_anything_is_installed(bare, bare_inventory, server):
    """The tarball is checked against its .sig with AWS's key (manual.rst's gpg --verify): with
    another key (here the apt repository's) the signature cannot be verified, and a pinned
    fingerprint that is not the signer's is refused too."""
    other_key = f"{server}/apt/GPG-PUB-KEY-EPD-STANDIN.PUB"
    result = provision(bare_inventory, pins("a", server, epd_provision_efa_installer_key_url=other_key))
    out = " ".join(result.stdout.split())
    assert result.returncode != 0, result.describe()
    assert "is not signed by" in out and "Can't check signature" in out and "Nothing was installed" in out, out
    result = provision(bare_inventory, pins("a", server, epd_provision_efa_installer_key_fingerprint="AB" * 20))
    out = " ".join(result.stdout.split())
    assert result.returncode != 0, result.describe()
    assert "is not signed by the key " + "AB" * 20 in out and "Nothing was installed" in out, out
    assert_untouched(bare)


def test_the_old_requirement_set_fails_on_pips_conflict_before_anything_is_installed(bare, bare_inventory, server):
    """The engine venv set the kit had before the release table (Neuron 2.31's torch-neuronx 2.9 and
    nixl 1.5.1 beside vllm 0.24): pip's resolver refuses it on the controller, naming the conflict."""
    old = pins("a", server)
    old["epd_provision_engine_pins"] = old["epd_provision_engine_pins"] | {"nixl": "1.5.1"}
    old["epd_provision_engine_extra_requirements"] = ["torch-neuronx==2.9.0.2.15.32035+standin"]
    result = provision(bare_inventory, old)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode != 0, result.describe()
    assert "the requirements' dependencies conflict" in out, out[-4000:]
    assert "The user requested nixl==1.5.1" in out and "depends on nixl==1.3.2" in out, out[-4000:]
    assert_untouched(bare)


def test_a_repository_whose_signature_does_not_verify_fails_before_anything_is_installed(bare, bare_inventory, server):
    # a key that did not sign the repository: apt refuses the repository's InRelease
    wrong_key = f"{server}/apt/dists/{standins.SUITE}/Release.gpg"
    result = provision(bare_inventory, pins("a", server, epd_provision_neuron_apt_key_url=wrong_key))
    assert result.returncode != 0, result.describe()
    assert "the Neuron apt repository does not serve the pins, nothing was installed" in result.stdout, (
        result.describe()
    )
    assert_untouched(bare)


def test_a_pin_the_repository_does_not_have_fails_before_anything_is_installed(bare, bare_inventory, server):
    result = provision(bare_inventory, pins("a", server, epd_provision_neuron_driver_version="9.9.9.9"))
    assert result.returncode != 0, result.describe()
    assert "aws-neuronx-dkms 9.9.9.9" in result.stdout, result.describe()
    assert_untouched(bare)


def test_a_host_without_the_cuda_repository_is_refused_before_anything_is_installed(bare, bare_inventory, server):
    """The CUDA driver stub comes from NVIDIA's repository through its cuda-keyring package (the setup
    guide's step): a keyring package the host cannot fetch, or a repository it cannot verify with that
    package's key, stops the run before the Neuron packages or EFA change, naming the step to run."""
    missing = f"{server}/no-such/{standins.CUDA_KEYRING_DEB}"
    result = provision(bare_inventory, pins("a", server, epd_provision_cuda_keyring_url=missing))
    out = " ".join(result.stdout.split())
    assert result.returncode != 0, result.describe()
    assert "NVIDIA's CUDA repository, which has cuda-cudart-dev-12-6" in out and "Nothing was installed" in out, out
    assert f"wget {missing} && dpkg -i {standins.CUDA_KEYRING_DEB}" in out, out
    # a keyring package whose key did not sign the repository (here: the Neuron stand-in's key in its place)
    wrong = f"{server}/cuda-keyring-wrong-key.deb"
    result = provision(bare_inventory, pins("a", server, epd_provision_cuda_keyring_url=wrong))
    out = " ".join(result.stdout.split())
    assert result.returncode != 0, result.describe()
    assert "apt-get update of" in out and "failed" in out and "Nothing was installed" in out, out
    assert_untouched(bare)


def test_a_missing_cuda_stub_fails_provisioning_naming_the_fix(bare, bare_inventory, server):
    """mistake: no libcuda.so.1 (epd_provision_cuda_stub=false on a host without one): the probe's
    ldd scan of NIXL's LIBFABRIC plugin finds it missing, and the message names the setting."""
    result = provision(bare_inventory, pins("a", server, epd_provision_cuda_stub=False))
    assert result.returncode != 0, result.describe()
    out = " ".join(result.stdout.split())
    assert "libcuda.so.1 => not found" in out, result.describe()
    assert "set epd_provision_cuda_stub=true" in out, result.describe()


def test_fresh_install_on_a_bare_host(bare, bare_inventory, server, record_timing):
    # what the manual leaves behind: its own entry for the same repository, without signed-by
    # (apt would stop on "Conflicting values set for option Signed-By" next to the kit's)
    bare.run(f"echo 'deb {server}/apt {standins.SUITE} main' > /etc/apt/sources.list.d/neuron.list")
    start = time.monotonic()
    result = provision(bare_inventory, pins("a", server))
    record_timing("provision: fresh bare host", time.monotonic() - start)
    assert result.returncode == 0, result.describe()
    assert_release(bare, "a")
    # libfabric where the EFA installer puts it, off the system loader path (the engines' LD_LIBRARY_PATH)
    assert bare.run("test -e /opt/amazon/efa/lib/libfabric.so.1 && echo yes").stdout.strip() == "yes"
    assert "libfabric.so.1" not in bare.run("ldconfig -p").stdout
    loader = bare.run("ldconfig -p").stdout
    assert "libcuda.so.1" in loader and "libhwloc.so.15" in loader, loader
    # the manual's entry was replaced by the kit's, not left beside it
    assert bare.run("cat /etc/apt/sources.list.d/neuron.list").stdout.strip() == ""
    # NIXL's real LIBFABRIC plugin of the backend nixl loads (nixl_cu12: the torch stand-in says
    # CUDA 12.6) finds everything (the probe's scan, run again here)
    plugin = bare.run(f"find {ENGINE_VENV}/ -path '*nixl_cu12*' -name libplugin_LIBFABRIC.so | head -1").stdout.strip()
    ldd = bare.run(f"LD_LIBRARY_PATH=/opt/amazon/efa/lib:/usr/local/cuda-12.6/targets/x86_64-linux/lib ldd {plugin}")
    assert plugin and "not found" not in ldd.stdout, ldd.stdout
    bare.run(
        f"{ENGINE_VENV}/bin/python -c 'import torch, nixl, vllm, vllm_neuron, neuronxcc, libtorch_neuronx_lite, nki'"
    )
    assert bare.run(f"readlink {ENGINE_VENV}").stdout.startswith(ENGINE_VENVS + "/")
    # the compiler came from a wheel published like the real one, for the host's platform only
    wheel = bare.run(f"cat {ENGINE_VENV}/lib/python3.11/site-packages/neuronx_cc-*.dist-info/WHEEL").stdout
    assert "Tag: cp311-cp311-linux_x86_64" in wheel, wheel
    # NVIDIA's repository came with its keyring package (the setup guide's dpkg -i), and the manual's g++
    assert bare.run("dpkg-query -W -f '${db:Status-Status}' cuda-keyring g++").stdout == "installedinstalled"
    # the security doc's device access
    assert 'GROUP="neuron"' in bare.run("cat /etc/udev/rules.d/neuron-udev.rules").stdout
    bare.run("getent group neuron")


def test_a_second_run_changes_nothing(bare, bare_inventory, server):
    result = provision(bare_inventory, pins("a", server))
    assert result.returncode == 0, result.describe()
    assert result.changed == 0, result.describe()
    assert "every pin is installed, nothing to do" in result.stdout
    # no driver reload (it reports changed) and no reboot request
    assert bare.run("ls /run/epd/reboot-required 2>/dev/null; true").stdout == "", result.describe()


def versions_status(inventory: Path, variables: dict) -> str:
    result = playbook(inventory, "playbooks/status.yml", variables, "--tags", "versions")
    assert result.returncode == 0, result.describe()
    return result.stdout


def version_row(out: str, host: TestHost) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.split()[:1] == [host.name] and "ok=" not in line)


def test_status_shows_the_versions_and_no_drift(bare, bare_inventory, server):
    out = versions_status(bare_inventory, pins("a", server))
    row = version_row(out, bare)
    assert row[-1] == "ok" and "DRIFT" not in out, out
    assert standins.RELEASE_A.vllm_neuron in row and "1.47.0amzn1.0-standin1" in row, out


def test_check_mode_reports_a_pin_change_and_changes_nothing(bare, bare_inventory, server):
    link = bare.run(f"readlink {ENGINE_VENV}").stdout
    result = provision(bare_inventory, pins("b", server), "--check")
    assert result.returncode == 0, result.describe()
    assert result.changed > 0, result.describe()
    assert "--check: would install aws-neuronx-dkms=2.30.3.0-standin1" in result.stdout, result.describe()
    assert_release(bare, "a")
    assert bare.run(f"readlink {ENGINE_VENV}").stdout == link


def test_a_pin_change_upgrades_and_keeps_the_previous_venv(bare, bare_inventory, server):
    before = bare.run(f"readlink {ENGINE_VENV}").stdout.strip()
    result = provision(bare_inventory, pins("b", server))
    assert result.returncode == 0, result.describe()
    assert_release(bare, "b")
    after = bare.run(f"readlink {ENGINE_VENV}").stdout.strip()
    assert after != before
    assert sorted(bare.run(f"ls -d {ENGINE_VENVS}/*").stdout.split()) == sorted([before, after])
    # status flags a host that differs from the pins (here: the old pins against the upgraded host)
    out = versions_status(bare_inventory, pins("a", server))
    new, old = standins.RELEASE_B.vllm_neuron, standins.RELEASE_A.vllm_neuron
    assert f"DRIFT {bare.name}: vllm_neuron {new}, pin {old} (newer: kept)" in " ".join(out.split()), out


def test_older_pins_leave_a_newer_host_alone(bare, bare_inventory, server):
    result = provision(bare_inventory, pins("a", server))
    assert result.returncode == 0, result.describe()
    assert result.changed == 0, result.describe()
    assert "newer than the pin: kept" in " ".join(result.stdout.split()), result.describe()
    assert_release(bare, "b")


def test_setting_the_pins_back_with_allow_downgrade_rolls_back_without_reinstalling_the_venv(
    bare, bare_inventory, server
):
    previous = sorted(bare.run(f"ls -d {ENGINE_VENVS}/*").stdout.split())
    stamps = {d: bare.run(f"stat -c %Y {d}/.epd-complete").stdout.strip() for d in previous}
    result = provision(bare_inventory, pins("a", server, epd_provision_allow_downgrade=True))
    assert result.returncode == 0, result.describe()
    assert_release(bare, "a")
    assert sorted(bare.run(f"ls -d {ENGINE_VENVS}/*").stdout.split()) == previous
    assert {d: bare.run(f"stat -c %Y {d}/.epd-complete").stdout.strip() for d in previous} == stamps


def test_a_dlami_like_host_newer_than_the_pins_is_left_alone(host_pool, server, tmp_path_factory):
    (dlami,) = host_pool.up(DLAMI, variant="dlami")
    release = standins.RELEASES["b"]  # the image is newer than the kit's pins (release a)
    # what the DLAMI's image build did: the Neuron packages, the EFA software, the CUDA stub, hwloc, a vLLM venv
    keyring = "/usr/share/keyrings/standin-neuron.asc"
    debs = " ".join(f"{p}={v}-{standins.DEB_REVISION}" for p, v in release.neuron.items())
    debs += " " + " ".join(standins.HWLOC_PACKAGES + standins.GXX_PACKAGES)
    efa = f"aws-efa-installer-{release.efa_installer}.tar.gz"
    server_host = server.removeprefix("http://").split(":")[0]
    wheels = " ".join(f"{d}=={v}" for d, v in release.engine_venv.items())
    dlami.run(
        f"set -e; curl -fsS -o {keyring} {server}/apt/GPG-PUB-KEY-EPD-STANDIN.PUB; "
        f"echo 'deb [signed-by={keyring}] {server}/apt {standins.SUITE} main' > /etc/apt/sources.list.d/image.list; "
        f"curl -fsS -o /tmp/cuda-keyring.deb {server}/{standins.CUDA_KEYRING_DEB}; dpkg -i /tmp/cuda-keyring.deb; "
        "apt-get update -o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts=/etc/apt/sources.list.d -qq; "
        f"DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-headers-{standins.KERNEL}; "
        f"DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {debs} {standins.CUDA_STUB_PACKAGES[0]}; "
        "ln -sf /usr/local/cuda-12.6/targets/x86_64-linux/lib/stubs/libcuda.so /usr/local/lib/libcuda.so.1; ldconfig; "
        f"cd /tmp && curl -fsS -O {server}/efa/{efa} && tar -xzf {efa} && aws-efa-installer/efa_installer.sh -y; "
        f"python3 -m venv {DLAMI_VENV}; "
        f"{DLAMI_VENV}/bin/pip install -q --no-index --no-deps --trusted-host {server_host} "
        f"--find-links {server.rsplit('/', 1)[0]}/wheels/ "
        f"--find-links {server}/pip/ {wheels}",
        timeout=300,
    )
    inventory = inventory_for(dlami, tmp_path_factory.mktemp("inventory-dlami"))
    result = provision(inventory, pins("a", server, epd_provision_engine_venv=DLAMI_VENV))
    assert result.returncode == 0, result.describe()
    assert result.changed == 0, result.describe()
    assert "newer than the pin: kept" in " ".join(result.stdout.split()), result.describe()
    assert f"aws-neuronx-dkms {release.neuron['aws-neuronx-dkms']}-{standins.DEB_REVISION}" in " ".join(
        dlami.run("dpkg-query -W aws-neuronx-dkms").stdout.split()
    )
    left = dlami.run(f"ls -d {PROVISIONED[0]} {PROVISIONED[1]} {ENGINE_VENVS} 2>/dev/null; true").stdout.split()
    assert left == [], f"provisioning touched the DLAMI-like host: {left}"


@pytest.mark.timeout(600)  # a first deploy on a loaded 2-core machine (docs/sandbox.md: 57-84 s unloaded)
def test_the_sim_stack_deploys_on_the_provisioned_bare_host(bare, bare_inventory, server, host_pool):
    host_pool.require_model()
    result = playbook(bare_inventory, "playbooks/deploy.yml", pins("a", server))
    assert result.returncode == 0, result.describe()
    for unit in ("epd-engine@ve-0.service", "epd-engine@pd-0.service", "epd-router.service"):
        assert bare.is_active(unit) == "active", unit
    status = playbook(bare_inventory, "playbooks/status.yml", pins("a", server))
    assert status.returncode == 0, status.describe()
    assert version_row(status.stdout, bare)[-1] == "ok" and "DRIFT" not in status.stdout, status.describe()


def test_a_parts_tag_installs_that_part_alone(bare, bare_inventory, server):
    """docs/provisioning.md's tags: `--tags epd_provision_efa` with release b's pins on the host of
    release a runs the role's checks, the read of the host and the EFA part: the EFA software moves to
    b, the Neuron packages and the engine venv stay a's (their parts are not run)."""
    assert_release(bare, "a")
    result = provision(bare_inventory, pins("b", server), "--tags", "epd_provision_efa")
    assert result.returncode == 0, result.describe()
    assert "Check the role's variables and the host's operating system" in result.stdout, result.describe()
    record = bare.run("cat /opt/amazon/efa_installed_packages").stdout
    assert f"EFA installer version: {standins.RELEASE_B.efa_installer}" in record, record
    versions = installed(bare)
    for package, version in standins.RELEASE_A.neuron.items():
        assert versions.get(package) == f"{version}-{standins.DEB_REVISION}", versions
    assert engine_versions(bare, tuple(standins.RELEASE_A.engine_venv)) == standins.RELEASE_A.engine_venv
