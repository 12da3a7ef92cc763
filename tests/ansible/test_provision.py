"""epd_provision without test hosts: the version facts module, the role's variable checks, the
apt repository check against the stand-in repository, the engine wheelhouse builder's key.
The installs themselves run on real hosts in tests/e2e/test_provision_hosts.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from tests import repo_modules
from tests.ansible.helpers import LOCAL_HOST, REPO, host_output, local_play, playbook
from tests.budget import scaled
from tests.hosts.standins import build as standins

pytestmark = pytest.mark.ansible

versions_module = repo_modules.module("epd_host_versions")
CHECK_APT = REPO / "roles/epd_provision/files/check_apt_repository.sh"
ENGINE_WHEELHOUSE = REPO / "roles/epd_common/files/build_engine_wheelhouse.py"

DPKG_STATUS = """\
Package: aws-neuronx-dkms
Status: install ok installed
Version: 2.24.7.0-dcd0b2d2d

Package: aws-neuronx-runtime-lib
Status: deinstall ok config-files
Version: 2.28.23.0-1

Package: libfabric1
Status: install ok installed
Multi-Arch: same
Version: 1.17.0-3
Description: libfabric
 a continuation line: Version: 0.0
"""
EFA_RECORD = "# EFA installer version: 1.41.0\n# Debug packages installed: no\nlibfabric-aws-bin 2.1.0amzn3.0\n"


def test_installed_packages_are_read_from_dpkg_status():
    assert versions_module.installed_debian_packages(DPKG_STATUS) == {
        "aws-neuronx-dkms": "2.24.7.0-dcd0b2d2d",
        "libfabric1": "1.17.0-3",
    }


def test_the_efa_installer_version_comes_from_its_record():
    assert versions_module.efa_installer_version(EFA_RECORD) == "1.41.0"
    assert versions_module.efa_installer_version(None) is None


@pytest.mark.parametrize(
    ("pin", "installed", "matches"),
    [
        ("2.24.7.0", "2.24.7.0-dcd0b2d2d", True),  # the upstream part of a Debian version
        ("2.24.7.0", "2.24.7.0", True),
        ("2.24.7.0-1", "2.24.7.0-1", True),
        ("2.24.7.0", "2.24.7.01-1", False),
        ("2.24.7.0", "1:2.24.7.0-1", True),  # an epoch is not part of the pin
        ("0.4.0+standin", "0.4.0+standin", True),
        ("0.6.0", "0.6.0+standin", True),  # pip's == ignores a local label the pin does not have
        ("0.6.0+other", "0.6.0+standin", False),
        ("1.5.1", None, False),
    ],
)
def test_a_pin_matches_the_version_or_its_upstream_part(pin, installed, matches):
    assert versions_module.matches(pin, installed) is matches


def test_drift_lists_what_differs_and_skips_empty_pins():
    versions = {"driver": "2.24.7.0-1", "nixl": None, "vllm": "0.24.0"}
    expected = {"driver": "2.24.7.0", "nixl": "1.5.1", "vllm": "0.25.0", "tools": ""}
    assert versions_module.drift(versions, expected) == [
        {"component": "nixl", "expected": "1.5.1", "installed": None, "newer": False},
        {"component": "vllm", "expected": "0.25.0", "installed": "0.24.0", "newer": False},
    ]


@pytest.mark.parametrize(
    ("installed", "pin", "newer"),
    [
        ("2.30.3.0-standin1", "2.30.2.0", True),  # a newer DLAMI driver: kept
        ("2.30.2.0-1", "2.30.10.0", False),  # numbers compare as numbers
        ("0.24.0.1.2.0+standin", "0.24.0.1.1.0", True),
        ("1:2.35.0.0-1", "2.34.10.0", True),  # an epoch is not part of the comparison
        (None, "1.5.1", False),
    ],
)
def test_drift_says_whether_the_host_is_newer_than_the_pin(installed, pin, newer):
    assert versions_module.newer(installed, pin) is newer


def run_module_play(tmp_path: Path, args: dict) -> dict:
    """The module through ansible-playbook on localhost; returns its registered result."""
    return local_play(tmp_path, [{"name": "Read", "epd.kit.epd_host_versions": args, "register": "read"}], ["read"])[
        "read"
    ]


def test_the_module_reports_versions_nulls_and_drift(tmp_path):
    (tmp_path / "status").write_text(DPKG_STATUS)
    (tmp_path / "efa").write_text(EFA_RECORD)
    read = run_module_play(
        tmp_path,
        {
            "dpkg_status": str(tmp_path / "status"),
            "efa_record": str(tmp_path / "efa"),
            "kit_python": sys.executable,  # the venv running these tests has the kit installed
            "engine_python": str(tmp_path / "no-venv/bin/python"),
            "expected": {"driver": "2.24.7.0", "runtime": "2.28.23.0", "efa_installer": "1.41.0", "nixl": "1.5.1"},
        },
    )
    versions = read["versions"]
    assert versions["driver"] == "2.24.7.0-dcd0b2d2d"
    assert versions["runtime"] is None  # removed, only its configuration files are left
    assert versions["libfabric"] == "1.17.0-3"
    assert versions["efa_installer"] == "1.41.0"
    assert versions["kit"] == metadata.version("epd-kit")
    assert versions["nixl"] is versions["vllm"] is versions["vllm_neuron"] is None
    assert sorted(d["component"] for d in read["drift"]) == ["nixl", "runtime"]
    assert read["changed"] is False


def provision_locally(root: Path, hosts: dict[str, dict], **variables) -> subprocess.CompletedProcess[str]:
    """provision.yml against this machine: a local host per case (`hosts`: its variables, as host
    vars) and `variables` given with -e, all of them ones its preflight refuses: nothing runs past it."""
    root.mkdir(parents=True, exist_ok=True)
    inventory = root / "hosts.yml"
    engines = {name: {**LOCAL_HOST, **host} for name, host in hosts.items()}
    inventory.write_text(yaml.safe_dump({"all": {"children": {"epd_engines": {"hosts": engines}}}}))
    extra = root / "vars.json"
    extra.write_text(json.dumps(variables))
    return playbook("-i", str(inventory), "playbooks/provision.yml", "-e", f"@{extra}")


# (variables, message, run): the cases of one `run` are the hosts of one provision.yml run (a run is
# ~3 CPU-s), each host carrying its case's variables and read for its own message. Cases share a
# run only where each host's mistake is reported on its own: the inventory check lists every
# host's shape problems (run "shape") and its cross-setting rules once no shape problem is left
# ("rules"); epd_neuron_release is one value for the fleet ("2.31.0" alone), and the role's
# preflight fails each host on its own ("2.33.0").
PIN_CASES = [
    # the inventory check refuses these on the controller first (docs/planner.md "Settings checked
    # by their shape and by each other"); the role's own preflight keeps the same rules
    (
        {"epd_provision_engine_pins": {"vllm-neuron": ""}},
        "epd_provision_engine_pins['vllm-neuron'] is '': write a version",
        "shape",
    ),
    (
        {"epd_provision_efa_installer_sha256": "abc"},
        "epd_provision_efa_installer_sha256 is 'abc': write 64 lowercase hex",
        "shape",
    ),
    (
        {"epd_provision_efa_installer_key_fingerprint": "4E90 91BC"},
        "key_fingerprint is '4E90 91BC': write 40 hex digits",
        "shape",
    ),
    (
        {"epd_provision_neuron_driver_version": "latest"},
        "epd_provision_neuron_driver_version is 'latest': write a version",
        "shape",
    ),
    # mistake: the framework of another release (Neuron 2.31's torch-neuronx) pinned as an override
    (
        {"epd_provision_engine_pins": {"torch-neuronx": "2.9.0.2.15.32035"}},
        "epd_provision_engine_pins sets torch-neuronx, which Neuron 2.32.0's engine venv does not list",
        "rules",
    ),
    # mistake: a release the kit has no table for
    (
        {"epd_neuron_release": "2.31.0"},
        "epd_neuron_release must be one of 2.32.0, 2.33.0, 2.33.1, got '2.31.0'",
        "2.31.0",
    ),
    # mistake: Neuron 2.33.0 without the pins its sources leave unconfirmed (the kit does not guess them)
    (
        {"epd_neuron_release": "2.33.0"},
        "Neuron 2.33.0: no source the kit read settles libtorch-neuronx-lite, nixl, the EFA installer version. "
        "Set them from that release's documentation: epd_provision_engine_pins (libtorch-neuronx-lite: <version>, "
        "nixl: <version>) epd_provision_efa_installer_version",
        "2.33.0",
    ),
    (
        {
            "epd_neuron_release": "2.33.0",
            "epd_provision_engine_pins": {"nixl": "1.5.1"},
            "epd_provision_efa": False,
        },
        "Neuron 2.33.0: no source the kit read settles libtorch-neuronx-lite. Set them",
        "2.33.0",
    ),
    # mistake: --minimal installs no libfabric (efa_installer.sh usage text)
    ({"epd_provision_efa_installer_options": ["--yes", "--minimal"]}, "remove --minimal", "rules"),
]


@pytest.fixture(scope="module")
def pin_runs(tmp_path_factory):
    """case index -> (its run's result, its host): each run of PIN_CASES once, when a case first asks."""
    runs: dict[str, subprocess.CompletedProcess[str]] = {}

    def outcome(index: int) -> tuple[subprocess.CompletedProcess[str], str]:
        run = PIN_CASES[index][2]
        if run not in runs:
            hosts = {f"case{i}": variables for i, (variables, _, r) in enumerate(PIN_CASES) if r == run}
            runs[run] = provision_locally(tmp_path_factory.mktemp(f"pins-{run}"), hosts)
        return runs[run], f"case{index}"

    return outcome


@pytest.mark.parametrize(("variables", "message"), [case[:2] for case in PIN_CASES])
def test_the_preflight_refuses_bad_pins_before_reading_the_host(pin_runs, variables, message):
    result, host = pin_runs(next(i for i, case in enumerate(PIN_CASES) if case[:2] == (variables, message)))
    output = " ".join((result.stdout + result.stderr).split())
    mine = " ".join(host_output(result.stdout + result.stderr, host).split())  # this case's host alone
    assert result.returncode != 0, output[-3000:]
    assert message in mine, f"{host} ({variables}): {output[-3000:]}"
    assert "Read the installed versions" not in output


def test_a_python_below_3_11_is_refused_before_anything_changes(tmp_path):
    """mistake: the engine venv's Python is 3.10 (Ubuntu 22.04's default): refused in preflight, naming the fix."""
    python = tmp_path / "python3.10"
    python.write_text("#!/bin/sh\necho 3.10 x86_64 2.35\n")
    python.chmod(0o755)
    result = provision_locally(
        tmp_path / "run", {"local": {}}, epd_provision_engine_python=str(python), epd_provision_extra_os=["Debian 12"]
    )
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode != 0, output[-3000:]
    assert "is Python 3.10 on x86_64 with glibc 2.35:" in output, output[-3000:]
    assert "packages are built for Python 3.11 to 3.13" in output, output[-3000:]
    assert "set epd_provision_engine_python" in output and "Nothing was changed" in output, output[-3000:]
    assert "Read the installed versions" not in output


@pytest.fixture(scope="module")
def standin_apt() -> Path:
    target = standins.standin_dir()
    if not (target / "manifest.json").exists():
        pytest.skip(
            f"no stand-in apt repository at {target}: tests/hosts/wheelhouse.py builds it (needs the Debian mirror)"
        )
    return target / "apt"


def check_apt(tmp_path: Path, apt: Path, key: Path, *pins: str) -> subprocess.CompletedProcess[str]:
    sources = tmp_path / "sources.list"
    sources.write_text(f"deb [signed-by={key}] file://{apt} {standins.SUITE} main\n")
    argv = ["bash", str(CHECK_APT), str(tmp_path / "scratch"), str(sources), *pins]
    return subprocess.run(argv, capture_output=True, text=True, timeout=scaled(60), check=False)


def test_the_repository_check_resolves_each_pin_to_its_exact_version(tmp_path, standin_apt):
    result = check_apt(tmp_path, standin_apt, standin_apt / "GPG-PUB-KEY-EPD-STANDIN.PUB", "aws-neuronx-dkms=2.30.2.0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == [f"aws-neuronx-dkms=2.30.2.0-{standins.DEB_REVISION}"]


def test_the_repository_check_refuses_a_repository_signed_with_another_key(tmp_path, standin_apt):
    not_the_key = tmp_path / "other.asc"
    not_the_key.write_bytes((standin_apt / f"dists/{standins.SUITE}/Release.gpg").read_bytes())
    result = check_apt(tmp_path, standin_apt, not_the_key, "aws-neuronx-dkms=2.30.2.0")
    assert result.returncode == 1
    assert "is not signed" in result.stdout or "NO_PUBKEY" in result.stdout, result.stdout


def test_the_repository_check_names_a_missing_pin(tmp_path, standin_apt):
    key = standin_apt / "GPG-PUB-KEY-EPD-STANDIN.PUB"
    result = check_apt(tmp_path, standin_apt, key, "aws-neuronx-dkms=2.30.2.0", "aws-neuronx-tools=9.9")
    assert result.returncode == 1
    assert result.stdout.strip().endswith("aws-neuronx-tools 9.9"), result.stdout


@pytest.mark.parametrize(
    ("keyring_deb", "found"), [(standins.CUDA_KEYRING_DEB, True), ("cuda-keyring-wrong-key.deb", False)]
)
def test_the_cuda_repository_is_read_with_the_key_its_keyring_package_carries(
    tmp_path, standin_apt, keyring_deb, found
):
    """The CUDA check reads the flat repository ("<url> /") with the keyring package's own key: the
    right package finds the stub package (any version: no pin), one with another key fails on apt's
    signature check."""
    unpacked = tmp_path / "keyring"
    subprocess.run(["dpkg-deb", "-x", str(standin_apt.parent / keyring_deb), str(unpacked)], check=True)
    sources = tmp_path / "cuda.list"
    sources.write_text(
        f"deb [signed-by={unpacked / standins.CUDA_KEYRING.lstrip('/')}] file://{standin_apt.parent}/cuda/ /\n"
    )
    argv = ["bash", str(CHECK_APT), str(tmp_path / "work"), str(sources), "cuda-cudart-dev-12-6"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(60), check=False)
    if found:
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.split() == [f"cuda-cudart-dev-12-6={standins.CUDA_VERSION}-1"]
    else:
        assert result.returncode == 1, result.stdout
        assert "apt-get update of" in result.stdout and ("NO_PUBKEY" in result.stdout or "not signed" in result.stdout)


def build_engine_wheelhouse(cache: Path, *args: str) -> dict:
    argv = [sys.executable, str(ENGINE_WHEELHOUSE), "--cache", str(cache), "--dry-run", *args]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


def test_the_engine_wheelhouse_key_ignores_requirement_order_and_a_dry_run_writes_nothing(tmp_path):
    cache = tmp_path / "cache"
    one = build_engine_wheelhouse(cache, "--requirement=vllm==0.24.0", "--requirement=nixl==1.5.1")
    other = build_engine_wheelhouse(cache, "--requirement=nixl==1.5.1", "--requirement=vllm==0.24.0")
    no_deps = build_engine_wheelhouse(cache, "--requirement=nixl==1.5.1", "--requirement=vllm==0.24.0", "--no-deps")
    assert one["key"] == other["key"] != no_deps["key"]
    assert one["changed"] is True and not cache.exists()


def test_every_role_variable_is_typed_in_the_argument_spec():
    role = REPO / "roles/epd_provision"
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text())
    options = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    assert set(options) == set(defaults)
    assert all(options[name]["default"] == value for name, value in defaults.items())


def status_versions(tmp_path: Path, engine: dict) -> str:
    inventory = tmp_path / "hosts.yml"
    local = {**LOCAL_HOST, **engine}
    groups = {"epd_engines": {"hosts": {"local": local}}, "epd_router": {"hosts": {"local": None}}}
    inventory.write_text(yaml.safe_dump({"all": {"children": groups}}))
    kit_venv = Path(sys.executable).parent.parent
    result = playbook(
        "-i", str(inventory), "playbooks/status.yml", "--tags", "versions", "-e", f"epd_kit_venv={kit_venv}"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Show host, unit, state and health" not in result.stdout  # the unit table is not part of --tags versions
    return result.stdout


def test_status_versions_compare_a_vllm_host_with_the_pins(tmp_path):
    """status.yml --tags versions on this machine: no Neuron stack here, so on a vllm-backend host
    every Neuron pin is drift; one table, no quoted reprs."""
    out = status_versions(tmp_path, {"epd_engine_backend": "vllm"})
    table = [line for line in out.splitlines() if line.strip().startswith(("HOST ", "local ")) and "ok=" not in line]
    assert len(table) == 2, out[-3000:]
    assert table[1].split()[1] == metadata.version("epd-kit"), out[-3000:]
    assert table[1].rstrip().endswith("differ"), out[-3000:]
    assert "DRIFT local: driver absent, pin 2.30.2.0" in out, out[-3000:]
    assert "'local:" not in out and '"local:' not in out, out[-3000:]


def test_status_versions_of_a_sim_host_without_the_stack_have_no_drift_lines(tmp_path):
    out = status_versions(tmp_path, {"epd_engine_backend": "sim"})
    assert "DRIFT" not in out, out[-3000:]
    assert "none (sim)" in out, out[-3000:]


def test_the_trn2_render_gives_vllm_engines_the_setup_guides_loader_path(rendered):
    """vllm-neuron setup guide: LD_LIBRARY_PATH=/opt/amazon/efa/lib64:/opt/amazon/efa/lib and
    PATH=/opt/amazon/efa/bin in the shell that runs `vllm serve`; the kit adds the CUDA runtime's
    directory (NIXL's LIBFABRIC plugin links libcudart.so.12) and /opt/aws/neuron/bin. PATH starts
    with the engine venv's bin: neuronx-cc, which compiles every cache miss, is a console script
    there (compiler/neuronx-cc/how-to-generate-neff.rst: "neuronx-cc is on your PATH")."""
    out = rendered(REPO / "inventory/examples/trn2-2e7pd")
    unit = next(out.glob("*/etc/systemd/system/epd-engine@.service")).read_text()
    library_path = "/opt/amazon/efa/lib64:/opt/amazon/efa/lib:/usr/local/cuda-12.6/targets/x86_64-linux/lib"
    assert f"Environment=LD_LIBRARY_PATH={library_path}\n" in unit, unit
    record = json.loads(next(out.glob("*/engines/pd-0.json")).read_text())
    venv_bin = str(Path(record["argv"][0]).parent)
    assert venv_bin.startswith("/opt/aws_neuronx_venv_pytorch_inference_vllm"), record["argv"][0]
    assert f"Environment=PATH={venv_bin}:/opt/amazon/efa/bin:/opt/aws/neuron/bin:" in unit, unit
    assert record["environment"]["LD_LIBRARY_PATH"] == library_path
    assert record["environment"]["PATH"].startswith(f"{venv_bin}:")


def fake_wheel(directory: Path, name: str, version: str, tag: str, requires: tuple[str, ...] = ()) -> None:
    """A minimal wheel file with the given tag and Requires-Dist (pip reads its METADATA)."""
    stem = f"{name}-{version}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {line}\n" for line in requires
    )
    with zipfile.ZipFile(directory / f"{stem}-{tag}.whl", "w") as wheel:
        wheel.writestr(f"{stem}.dist-info/METADATA", metadata)
        wheel.writestr(f"{stem}.dist-info/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n")
        wheel.writestr(f"{stem}.dist-info/RECORD", "")


def build_wheelhouse_for(tmp_path: Path, links: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    index = tmp_path / "empty-index"
    index.mkdir(exist_ok=True)
    argv = [
        sys.executable,
        str(ENGINE_WHEELHOUSE),
        "--cache",
        str(tmp_path / "cache"),
        "--index-url",
        f"file://{index}",
    ]
    result = subprocess.run([*argv, f"--find-links={links}", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return result, []
    with tarfile.open(json.loads(result.stdout)["archive"]) as archive:
        return result, sorted(archive.getnames())


def test_the_engine_wheelhouse_is_built_for_the_hosts_python_and_platform_not_the_controllers(tmp_path):
    """A controller on another Python minor (here: this one, 3.11, for hosts on 3.12 with glibc 2.39)
    downloads the hosts' wheels: cp312 and a manylinux tag their glibc accepts, never its own."""
    links = tmp_path / "links"
    links.mkdir()
    mine = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert mine != "cp312", "this test needs a controller that is not Python 3.12"
    fake_wheel(links, "engine_lib", "1.0", f"{mine}-{mine}-manylinux_2_28_x86_64")
    fake_wheel(links, "engine_lib", "1.0", "cp312-cp312-manylinux_2_28_x86_64")
    fake_wheel(links, "engine_lib", "1.0", "cp312-cp312-manylinux_2_40_x86_64")  # newer than the hosts' glibc
    fake_wheel(links, "engine_lib", "1.0", "cp312-cp312-manylinux_2_28_aarch64")
    result, names = build_wheelhouse_for(
        tmp_path, links, "--requirement=engine-lib==1.0", "--python-version=3.12", "--host-platform=x86_64:2.39"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert names == ["engine_lib-1.0-cp312-cp312-manylinux_2_28_x86_64.whl"]
    report = json.loads(result.stdout)
    assert report["python"] == "3.12" and "manylinux_2_39_x86_64" in report["platforms"]
    assert "manylinux_2_40_x86_64" not in report["platforms"]
    # the target is part of the key: the same requirements for another interpreter build another archive
    other, _ = build_wheelhouse_for(
        tmp_path,
        links,
        "--requirement=engine-lib==1.0",
        f"--python-version=3.{sys.version_info.minor}",
        "--host-platform=x86_64:2.39",
    )
    assert json.loads(other.stdout)["key"] != report["key"]


DRIVER_CASES = [
    ("2.30.2.0", "", [], False),  # the release profile's aws-neuronx-dkms is loaded: nothing to do
    ("2.30.1.0", "", ["-r neuron", "neuron"], False),  # an older one, no engine: reloaded
    ("2.30.1.0", "epd-engine@ve-0.service loaded active running", [], True),  # engines hold it: reboot
]


@pytest.fixture(scope="module")
def driver_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """driver.yml once, a local host per case (host driverN: DRIVER_CASES[N], its files under
    ROOT/driverN): each host reads its own module version and device directory and runs its own
    stub modprobe and systemctl (its bin first on the play's PATH); one run instead of three."""
    root = tmp_path_factory.mktemp("driver")
    hosts = {}
    for index, (loaded, engines, _, _) in enumerate(DRIVER_CASES):
        case = root / f"driver{index}"
        module, devices, bin_dir = case / "module", case / "dev", case / "bin"
        for directory in (module, devices, bin_dir):
            directory.mkdir(parents=True)
        (module / "version").write_text(loaded + "\n")
        (devices / "neuron0").write_text("")
        log = case / "modprobe.log"
        for name, body in (("modprobe", f'echo "$*" >> {log}'), ("systemctl", f"echo {engines!r}")):
            (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bin_dir / name).chmod(0o755)
        hosts[f"driver{index}"] = {**LOCAL_HOST, "driver_case": str(case)}
    (root / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    play = {
        "hosts": "all",
        "gather_facts": False,
        "vars": {"epd_neuron_release": "2.32.0"},
        "environment": {"PATH": f"{{{{ driver_case }}}}/bin:{os.environ['PATH']}"},
        "tasks": [
            {"ansible.builtin.include_role": {"name": "epd.kit.epd_provision", "tasks_from": "driver"}},
            {
                "ansible.builtin.copy": {
                    "content": "{{ epd_provision_reboot_reasons | default([]) | to_json }}",
                    "dest": "{{ driver_case }}/reasons.json",
                }
            },
        ],
    }
    book = root / "driver.yml"
    book.write_text(yaml.safe_dump([play], sort_keys=False))
    # extra vars (the role's vars/main.yml outranks play vars), templated for each host
    paths = root / "paths.json"
    paths.write_text(
        json.dumps(
            {
                "epd_provision_neuron_module_dir": "{{ driver_case }}/module",
                "epd_provision_neuron_device_dir": "{{ driver_case }}/dev",
            }
        )
    )
    return root, playbook("-i", str(root / "hosts.yml"), str(book), "-e", f"@{paths}")


@pytest.mark.parametrize(("loaded", "engines", "modprobe", "reboot"), DRIVER_CASES)
def test_the_loaded_driver_is_compared_with_the_release_profiles_dkms(driver_run, loaded, engines, modprobe, reboot):
    """driver.yml with no epd_provision_neuron_driver_version set (the default): the loaded driver is
    compared with the release profile's aws-neuronx-dkms (2.32.0: 2.30.2.0), so the pinned driver
    already loaded is neither reloaded nor waits for a reboot (before, it was compared with "")."""
    root, result = driver_run
    host = f"driver{DRIVER_CASES.index((loaded, engines, modprobe, reboot))}"
    mine = host_output(result.stdout, host)  # this case's host alone
    assert mine and "FAILED" not in mine and "UNREACHABLE" not in mine, result.stdout[-3000:]
    log = root / host / "modprobe.log"
    assert (log.read_text().splitlines() if log.exists() else []) == modprobe
    reasons = json.loads((root / host / "reasons.json").read_text())
    assert bool(reasons) == reboot, reasons
    if reboot:
        assert reasons == ["Neuron driver 2.30.1.0 is loaded and 2.30.2.0 installed, and engines are running"]


def test_the_hosts_platform_tags_are_pips_own_in_its_order():
    """The tags the wheelhouse asks pip for are the ones pip itself accepts on a host with that glibc,
    in pip's order: the manylinux tags newest first (legacy aliases beside theirs), then linux_<arch>.
    This machine is such a host: pip's own list for it is the reference."""
    from pip._vendor.packaging import tags

    sys.path.insert(0, str(ENGINE_WHEELHOUSE.parent))
    try:
        import build_engine_wheelhouse
    finally:
        sys.path.remove(str(ENGINE_WHEELHOUSE.parent))
    import platform

    machine, glibc = platform.machine(), platform.libc_ver()[1]
    assert build_engine_wheelhouse.host_platform_tags(machine, glibc) == list(tags.platform_tags())


def test_a_linux_x86_64_wheel_of_the_hosts_python_is_taken(tmp_path):
    """Wheels published as linux_x86_64 (neuronx-cc and nki on the Neuron pip repository, by third-party
    reports) are eligible on a host, so the wheelhouse takes them; a manylinux wheel of the same version is
    preferred where both exist, as pip prefers it."""
    links = tmp_path / "links"
    links.mkdir()
    fake_wheel(links, "neuronx_cc", "2.27.5334.0", "cp312-cp312-linux_x86_64")
    fake_wheel(links, "engine_lib", "1.0", "cp312-cp312-linux_x86_64")
    fake_wheel(links, "engine_lib", "1.0", "cp312-cp312-manylinux_2_28_x86_64")
    result, names = build_wheelhouse_for(
        tmp_path,
        links,
        "--requirement=neuronx-cc==2.27.5334.0",
        "--requirement=engine-lib==1.0",
        "--python-version=3.12",
        "--host-platform=x86_64:2.39",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert names == [
        "engine_lib-1.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        "neuronx_cc-2.27.5334.0-cp312-cp312-linux_x86_64.whl",
    ]


def test_a_wheelhouse_for_hosts_without_a_wheel_for_their_python_fails_naming_it(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    fake_wheel(links, "engine_lib", "1.0", "cp312-cp312-manylinux_2_28_x86_64")
    result, _ = build_wheelhouse_for(
        tmp_path, links, "--requirement=engine-lib==1.0", "--python-version=3.14", "--host-platform=x86_64:2.39"
    )
    assert result.returncode != 0
    assert "No matching distribution found for engine-lib==1.0" in result.stderr, result.stderr[-2000:]


def test_the_release_set_resolves_and_the_old_set_fails_on_pips_conflict(tmp_path):
    """The stand-ins carry the real Requires-Dist: the 2.32 table's set resolves with pip's resolver
    on, and the set the kit pinned before (2.31's torch-neuronx beside vllm 0.24, nixl 1.5.1) fails
    with pip's conflict named, as it would on a real controller."""
    target = standins.standin_dir()
    if not (target / "manifest.json").exists():
        pytest.skip(f"no stand-ins at {target}: tests/hosts/wheelhouse.py builds them (needs the Debian mirror)")
    variables = standins.provision_vars("a", target)
    argv = [sys.executable, str(ENGINE_WHEELHOUSE), "--cache", str(tmp_path / "cache")]

    def build(variables: dict) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv + standins.engine_wheelhouse_argv(variables), capture_output=True, text=True, check=False
        )

    fixed = build(variables)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    with tarfile.open(json.loads(fixed.stdout)["archive"]) as archive:
        names = archive.getnames()
    assert any(n.startswith("torch-2.11.0+standin") for n in names) and any(
        n.startswith("nixl_cu12-1.3.2") for n in names
    )
    old = variables | {
        "epd_provision_engine_pins": variables["epd_provision_engine_pins"] | {"nixl": "1.5.1"},
        "epd_provision_engine_extra_requirements": ["torch-neuronx==2.9.0.2.15.32035+standin"],
    }
    broken = build(old)
    assert broken.returncode != 0
    assert "the requirements' dependencies conflict" in broken.stderr, broken.stderr[-3000:]
    assert "The user requested nixl==1.5.1" in broken.stderr and "depends on nixl==1.3.2" in broken.stderr
    only_torch = variables | {"epd_provision_engine_extra_requirements": ["torch-neuronx==2.9.0.2.15.32035+standin"]}
    torch = build(only_torch)
    assert "vllm 0.24.0+standin depends on torch==2.11.0" in torch.stderr, torch.stderr[-3000:]
    assert "torch-neuronx 2.9.0.2.15.32035+standin depends on torch<2.10" in torch.stderr, torch.stderr[-3000:]


OS_CASES = [
    (
        {"distribution": "Amazon", "distribution_version": "2023", "distribution_major_version": "2023"},
        "Currently, PyTorch 2.9 is not available on Amazon Linux 2023 ... Use Ubuntu 24.04",
    ),
    (
        {"distribution": "Ubuntu", "distribution_version": "20.04", "distribution_major_version": "20"},
        "Neuron 2.32.0 installs on Ubuntu 24.04, Ubuntu 22.04",
    ),
    # the sandbox's Debian is refused like any OS no source lists, unless epd_provision_extra_os names it
    (
        {"distribution": "Debian", "distribution_version": "12.7", "distribution_major_version": "12"},
        "Neuron 2.32.0 installs on Ubuntu 24.04, Ubuntu 22.04",
    ),
]


@pytest.fixture(scope="module")
def os_run(tmp_path_factory) -> subprocess.CompletedProcess[str]:
    """The role's preflight once, a local host per OS case (host osN: OS_CASES[N]'s facts): each host
    fails on its own, and each test reads its own host's output (one run instead of three)."""
    root = tmp_path_factory.mktemp("os")
    hosts = {f"os{i}": {**LOCAL_HOST, "os_case_facts": facts} for i, (facts, _) in enumerate(OS_CASES)}
    (root / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    play = {
        "hosts": "all",
        "gather_facts": False,
        "vars": {"ansible_facts": "{{ os_case_facts }}"},
        "tasks": [{"ansible.builtin.include_role": {"name": "epd.kit.epd_provision", "tasks_from": "preflight"}}],
    }
    book = root / "os.yml"
    book.write_text(yaml.safe_dump([play], sort_keys=False))
    return playbook("-i", str(root / "hosts.yml"), str(book))


@pytest.mark.parametrize(("facts", "message"), OS_CASES)
def test_an_os_the_release_does_not_list_is_refused_quoting_the_source(os_run, facts, message):
    """Amazon Linux 2023 has no vLLM Neuron path in the sources (manual.rst, dlami.rst): preflight
    refuses it before anything changes, naming Ubuntu 24.04."""
    result, host = os_run, f"os{OS_CASES.index((facts, message))}"
    output = " ".join((result.stdout + result.stderr).split())
    mine = " ".join(host_output(result.stdout + result.stderr, host).split())  # this case's host alone
    assert result.returncode != 0, output[-3000:]
    assert message in mine, f"{host} ({facts['distribution']}): {output[-3000:]}"
    assert "Read the host's Python version" not in output


def listed_tasks(tmp_path: Path, tag: str) -> list[str]:
    """The provision role's task names that `provision.yml --tags TAG` runs (--list-tasks: no host
    is contacted; an include shows as its own task)."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"epd_engines": {"hosts": {"h1": LOCAL_HOST}}}}}))
    listing = playbook("-i", str(inventory), "playbooks/provision.yml", "--list-tasks", "--tags", tag)
    assert listing.returncode == 0, listing.stdout + listing.stderr
    engines = listing.stdout.split("play #2")[1].split("play #3")[0]
    marker = "epd.kit.epd_provision : "
    return [line.split(marker)[1].split("\t")[0] for line in engines.splitlines() if marker in line]


@pytest.mark.parametrize("tag", ["epd_provision_neuron", "epd_provision_efa", "epd_provision_engine_venv"])
def test_a_parts_tag_runs_the_checks_the_host_read_and_that_part(tmp_path, tag):
    """docs/provisioning.md's tags: one part alone still runs the role's checks and the read of what
    is installed, which the part's include needs (epd_provision_todo), then the part."""
    tasks = listed_tasks(tmp_path, tag)
    assert "Check the role's variables and the host's operating system" in tasks, tasks
    assert "Decide what this host needs" in tasks, tasks
    assert tasks[-1] == "Validate, install and verify what differs from the pins", tasks


def test_the_preflight_tag_reads_and_changes_nothing(tmp_path):
    tasks = listed_tasks(tmp_path, "epd_provision_preflight")
    assert "Check the role's variables and the host's operating system" in tasks, tasks
    assert "Validate, install and verify what differs from the pins" not in tasks, tasks
