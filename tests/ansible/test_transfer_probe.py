"""The NIXL check (plugins/modules/epd_transfer_probe.py) follows the vLLM Neuron setup guide, on
the nixl the kit installs (the Neuron release's pin, vllm-neuron 0.24's `nixl==1.3.2`) and the two
venv shapes a host can have: only the CUDA 12 backend (nixl-cu12) beside a torch built for CUDA 12
(or a CPU torch), as the sandbox's engine venv is, and the meta package's full install (nixl-cu12
and nixl-cu13) beside a CUDA 13 torch, as vllm 0.24.0's torch 2.11.0 from PyPI is.

The NIXL wheels are the real ones, the stand-in directory's (tests/hosts/standins/build.py's
REAL_WHEELS, which tests/hosts/wheelhouse.py downloads into its pip/ before the tests); torch is a
stand-in that carries what nixl and the loader look at: torch/version.py's `cuda`, the `Tensor`
nixl's `_api` annotates with at import and, like a CUDA build of torch, the CUDA runtime it loads at
import from outside the loader path. nixl 1.3.2 cannot be imported without torch (its
nixl/__init__.py reads torch.version.cuda), so every venv here has one. libfabric, libcuda, the
CUDA runtime and hwloc are stub libraries (tests/hosts/standins/build.py's builder) on the
module's library_path, each in a directory of its own so a test can leave one off. The module runs
with this machine's loader cache hidden (a private mount namespace): a machine with a CUDA toolkit
in /etc/ld.so.cache would otherwise resolve libcudart.so.13 for ldd, unlike a trn2 host, whose
CUDA runtime comes only with torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from epd_kit.plan.neuron_releases import DEFAULT_RELEASE, neuron_release
from tests.ansible.helpers import REPO
from tests.budget import scaled
from tests.hosts.standins import build as standins

STANDINS = standins.standin_dir()
pytestmark = [
    pytest.mark.ansible,
    pytest.mark.skipif(
        not (STANDINS / "manifest.json").exists(),
        reason=f"no stand-ins at {STANDINS}: tests/hosts/wheelhouse.py builds them (needs the Debian mirror and PyPI)",
    ),
    pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the NIXL backends in the stand-ins are cp311 wheels"),
]

MODULE = REPO / "plugins/modules/epd_transfer_probe.py"
# the real wheels of the stand-in directory the venvs are made of: NIXL and numpy (the backends
# import it), at the versions build.py downloads
WHEEL_VERSIONS = {
    dist: version
    for dist, _, version in (pin.partition("==") for pin in standins.REAL_WHEELS)
    if dist in ("nixl", "nixl-cu12", "nixl-cu13", "numpy")
}
# Stubs tests/hosts/standins/build.py has no source for: the CUDA 13 runtime (the CUDA 12 one's
# source under the soname and symbol version the cu13 plugin links: `readelf -V`,
# cudaGetErrorString@libcudart.so.13) and hwloc (the sandbox installs Debian's real libhwloc15;
# these are the functions the plugin links, `nm -D --undefined-only`).
HWLOC_STUB = """/* STAND-IN hwloc: no topology. */
int hwloc_topology_init(void **t) { return -1; }
int hwloc_topology_load(void *t) { return -1; }
void hwloc_topology_destroy(void *t) {}
int hwloc_topology_set_io_types_filter(void *t, int f) { return -1; }
int hwloc_get_type_depth(void *t, int type) { return -1; }
unsigned hwloc_get_nbobjs_by_depth(void *t, int d) { return 0; }
void *hwloc_get_obj_by_depth(void *t, int d, unsigned i) { return 0; }
int hwloc_get_local_numanode_objs(void *t, void *l, unsigned *n, void **o, unsigned long f) { return -1; }
"""
# a libfabric older than the plugin needs (Debian bookworm's libfabric 1.17 stops at FABRIC_1.6,
# nixl 1.3.2's plugin links fi_getinfo@FABRIC_1.7): build.py's stub without its FABRIC_1.7
# aliases, every function only under FABRIC_1.0/1.1
OLD_FABRIC_SOURCE = re.sub(
    r"^int fi_getinfo_1_7\(.*@FABRIC_1\.7\"\);\n", "", standins.STUBS["libfabric.so.1"][0], flags=re.M | re.S
)
OLD_FABRIC_VERSIONS = (
    "FABRIC_1.0 { global: fi_strerror; fi_version; fi_getinfo; fi_freeinfo; fi_dupinfo; local: *; };\\n"
    "FABRIC_1.1 { global: fi_fabric; } FABRIC_1.0;\\n"
)
SONAMES = ("libfabric.so.1", "libcuda.so.1", "libhwloc.so.15", "libcudart.so.12", "libcudart.so.13")


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    """<dir>/<soname>/<soname> for each stub, and <dir>/libfabric-old/libfabric.so.1."""
    root = tmp_path_factory.mktemp("stubs")
    source12, versions12 = standins.STUBS["libcudart.so.12"]
    extra = {
        "libcudart.so.13": (source12, versions12.replace("libcudart.so.12", "libcudart.so.13")),
        "libhwloc.so.15": (HWLOC_STUB, None),
    }
    with pytest.MonkeyPatch.context() as patch:
        for soname, stub in extra.items():
            if soname not in standins.STUBS:
                patch.setitem(standins.STUBS, soname, stub)
        for soname in SONAMES:
            standins.build_stub(soname, root / soname / soname, root)
        assert "FABRIC_1.7" not in OLD_FABRIC_SOURCE, "build.py's libfabric stub changed: update OLD_FABRIC_SOURCE"
        patch.setitem(standins.STUBS, "libfabric.so.1", (OLD_FABRIC_SOURCE, OLD_FABRIC_VERSIONS))
        standins.build_stub("libfabric.so.1", root / "libfabric-old/libfabric.so.1", root)
    return root


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory) -> dict[str, Path]:
    """Each NIXL wheel, numpy (the backends import it) and the sandbox's torch stand-in (the one
    vllm 0.24.0 pins) unpacked once from the stand-in directory: packages, bundled libraries, plugins."""
    root = tmp_path_factory.mktemp("nixl")
    patterns = {dist: f"{dist.replace('-', '_')}-{version}-*.whl" for dist, version in WHEEL_VERSIONS.items()}
    patterns["torch"] = f"torch-{standins.LEAF_VERSIONS['torch'][0]}+standin-*.whl"
    out = {}
    for dist, pattern in patterns.items():
        wheel = next((STANDINS / "pip").glob(pattern), None)
        assert wheel, f"no {pattern} in {STANDINS / 'pip'}: an incomplete stand-in directory, rebuild it"
        target = root / dist
        with zipfile.ZipFile(wheel) as archive:
            # not nixl_ep_* (the expert-parallel kernels) nor the .data headers and scripts: ~100 MB less each
            names = [n for n in archive.namelist() if not n.startswith("nixl_ep") and ".data/" not in n]
            archive.extractall(target, names)
        out[dist] = target
    return out


def site_packages(python: Path) -> Path:
    return python.parent.parent / f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"


def plugin_of(python: Path, backend: str) -> str:
    return str(site_packages(python) / f".{backend}.mesonpy.libs/plugins/libplugin_LIBFABRIC.so")


def torch_standin(site: Path, unpacked_torch: Path, cuda: str | None, preload: bool) -> Path | None:
    """The sandbox's torch stand-in (its Tensor is what nixl 1.3.2's _api needs at import) built for
    `cuda` (None: a CPU build); with `preload`, importing it loads that CUDA runtime (a stub) from
    site-packages, off the loader path, as a CUDA build of torch does. Returns that runtime's path."""
    shutil.copytree(unpacked_torch, site, dirs_exist_ok=True)
    version = site / "torch/version.py"
    text, changed = re.subn(r"^cuda = .*$", f"cuda = {cuda!r}", version.read_text(), flags=re.M)
    assert changed == 1, version.read_text()
    version.write_text(text)
    if cuda is None or not preload:
        return None
    major = cuda.split(".")[0]
    runtime = site / f"nvidia/cu{major}/lib/libcudart.so.{major}"
    with (site / "torch/__init__.py").open("a") as init:
        init.write(f"\nimport ctypes\n\nctypes.CDLL({str(runtime)!r}, mode=ctypes.RTLD_GLOBAL)\n")
    return runtime


@pytest.fixture(scope="module")
def venv(tmp_path_factory, unpacked, stubs):
    """venv(dists, torch_cuda, preload=True) -> its python: the NIXL distributions, numpy and the
    torch stand-in built for torch_cuda (None: a CPU torch) in its site-packages."""
    made: dict[tuple, Path] = {}

    def make(dists: tuple[str, ...], torch_cuda: str | None, preload: bool = True) -> Path:
        key = (dists, torch_cuda, preload)
        if key not in made:
            root = tmp_path_factory.mktemp("venv")
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
            site = site_packages(root / "bin/python")
            for dist in (*dists, "numpy"):  # installed as pip lays a wheel out, hard links to the unpacked files
                shutil.copytree(unpacked[dist], site, copy_function=os.link, dirs_exist_ok=True)
            runtime = torch_standin(site, unpacked["torch"], torch_cuda, preload)
            if runtime:
                runtime.parent.mkdir(parents=True)
                shutil.copy2(stubs / runtime.name / runtime.name, runtime)
            made[key] = root / "bin/python"
        return made[key]

    return make


CU12_ONLY = ("nixl", "nixl-cu12")
BOTH = ("nixl", "nixl-cu12", "nixl-cu13")
# what provision puts on the engines' loader path (epd_engine_library_path): libfabric, the CUDA
# driver stub; hwloc comes from the system
HOST_LIBRARIES = ("libfabric.so.1", "libcuda.so.1", "libhwloc.so.15")


def probe(python: Path, stubs: Path, libraries=HOST_LIBRARIES, agent: bool = False) -> dict:
    """The module's result: run as Ansible runs it (its arguments in a file), under a private
    mount namespace with /etc/ld.so.cache hidden, so only library_path and the system directories
    resolve libraries."""
    args = {
        "python": str(python),
        "libraries": ["libfabric.so.1", "libcuda.so.1"],
        "library_path": [str(stubs / lib) for lib in libraries],
        "backend": "LIBFABRIC",
        "agent": agent,
    }
    args_file = python.parent.parent / "module-args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    hide_cache = 'mount --bind /dev/null /etc/ld.so.cache && exec "$@"'
    argv = ["unshare", "--mount", "--map-root-user", "sh", "-c", hide_cache, "sh", sys.executable, str(MODULE)]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "NIXL_PLUGIN_DIR")}
    result = subprocess.run(
        [*argv, str(args_file)], capture_output=True, text=True, timeout=scaled(120), env=env, check=False
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(result.stdout)


def test_the_wheels_are_the_nixl_the_kit_installs():
    pin = neuron_release(DEFAULT_RELEASE).profile()["engine_venv"]["nixl"]
    assert WHEEL_VERSIONS["nixl"] == WHEEL_VERSIONS["nixl-cu12"] == WHEEL_VERSIONS["nixl-cu13"] == pin


@pytest.mark.parametrize(
    "torch_cuda",
    [
        # the sandbox's engine venv: its torch stand-in reports CUDA 12.6 and loads no runtime; the
        # runtime comes from cuda-cudart-12-6, on the loader path
        "12.6",
        # a CPU torch (version.cuda None): nixl 1.3.2 takes the backend installed (nixl/__init__.py)
        None,
    ],
)
def test_a_cu12_only_venv_passes_with_the_cuda_12_runtime_on_the_loader_path(venv, stubs, torch_cuda):
    python = venv(CU12_ONLY, torch_cuda=torch_cuda, preload=False)
    out = probe(python, stubs, libraries=(*HOST_LIBRARIES, "libcudart.so.12"))
    assert out["problems"] == [] and out["notes"] == [], out
    assert out["nixl"] == {"backend": "nixl_cu12", "torch": "2.11.0+standin", "torch_cuda": torch_cuda}
    assert out["plugin"]["path"] == plugin_of(python, "nixl_cu12")
    assert out["plugin"]["not_found"] == [] and out["plugin"]["loads"] is True


def test_a_cu13_torch_venv_passes_with_libcudart_13_left_unresolved_because_torch_loaded_it(venv, stubs):
    python = venv(BOTH, torch_cuda="13.0")
    out = probe(python, stubs)
    assert out["problems"] == [], out
    assert out["nixl"] == {"backend": "nixl_cu13", "torch": "2.11.0+standin", "torch_cuda": "13.0"}
    assert out["plugin"]["path"] == plugin_of(python, "nixl_cu13")
    assert out["plugin"]["not_found"] == ["libcudart.so.13 => not found"]
    loaded = out["plugin"]["loaded"]["libcudart.so.13"]
    assert loaded == str(site_packages(python) / "nvidia/cu13/lib/libcudart.so.13")
    assert len(out["notes"]) == 1 and "libcudart.so.13 => not found" in out["notes"][0] and loaded in out["notes"][0]
    assert out["plugin"]["loads"] is True


def test_the_plugin_scanned_is_the_backend_nixl_chose_from_torchs_cuda(venv, stubs):
    # both backends installed, torch built for CUDA 12: nixl loads nixl_cu12, and its plugin is scanned
    python = venv(BOTH, torch_cuda="12.6")
    out = probe(python, stubs)
    assert out["problems"] == [], out
    assert out["nixl"]["backend"] == "nixl_cu12"
    assert out["plugin"]["path"] == plugin_of(python, "nixl_cu12")
    assert out["plugin"]["not_found"] == ["libcudart.so.12 => not found"] and len(out["notes"]) == 1


def test_libcudart_neither_on_the_loader_path_nor_loaded_by_torch_fails(venv, stubs):
    # the guide's "can be left unresolved" holds only when something loaded it: else dlopen fails
    out = probe(venv(BOTH, torch_cuda="13.0", preload=False), stubs)
    assert out["notes"] == [] and out["plugin"]["loads"] is False, out
    assert len(out["problems"]) == 1, out["problems"]
    assert out["problems"][0].startswith("NIXL's LIBFABRIC plugin: libcudart.so.13 => not found, nor loaded by")
    assert "libcudart.so.13" in out["plugin"]["error"]


@pytest.mark.parametrize(
    ("missing", "fix"),
    [
        ("libfabric.so.1", "install libfabric with the EFA installer"),
        ("libcuda.so.1", "install the CUDA driver stub"),
        ("libhwloc.so.15", "install hwloc's library"),
    ],
)
def test_a_missing_host_library_fails_naming_it_and_its_fix(venv, stubs, missing, fix):
    libraries = tuple(lib for lib in HOST_LIBRARIES if lib != missing)
    out = probe(venv(BOTH, torch_cuda="13.0"), stubs, libraries=libraries)
    named = [p for p in out["problems"] if f"NIXL's LIBFABRIC plugin: {missing} => not found ({fix}" in p]
    assert named, out["problems"]
    assert not any("libcudart" in p for p in out["problems"]), out["problems"]


def test_a_libfabric_older_than_the_plugin_needs_fails_on_the_symbol_version(venv, stubs):
    out = probe(venv(BOTH, torch_cuda="13.0"), stubs, libraries=("libfabric-old", "libcuda.so.1", "libhwloc.so.15"))
    too_old = [p for p in out["problems"] if "version `FABRIC_1.7' not found" in p]
    assert too_old and "this libfabric is older than the plugin needs" in too_old[0], out["problems"]


def test_a_cuda_13_torch_with_only_nixl_cu12_fails_with_nixls_own_message(venv, stubs):
    out = probe(venv(CU12_ONLY, torch_cuda="13.0"), stubs)
    assert out["problems"] == ["import nixl failed (torch reports CUDA 13 but nixl-cu13 is not installed)"], out
    assert out["nixl"]["backend"] is None and out["plugin"]["path"] is None


def test_the_agent_probe_runs_as_an_engine_does_torch_first(venv, stubs):
    # libcudart.so.13 only in the process (torch loaded it): the plugin loads and the agent gets as
    # far as the stub libfabric and hwloc let it (no provider, no topology); without torch first
    # NIXL could not load the plugin and would say "unsupported backend 'LIBFABRIC'". nixl 1.3.2
    # imports torch itself before its backend (nixl/__init__.py, _get_torch_cuda_major), so here
    # the probe's own `import torch` is not what puts it first: this fails when the agent runs
    # without the engines' loader path or not at all
    out = probe(venv(BOTH, torch_cuda="13.0"), stubs, agent=True)
    assert out["agent"]["created"] is False, out
    assert "unsupported backend" not in out["agent"]["output"], out["agent"]["output"]
    assert "backend creation failed for 'LIBFABRIC'" in out["agent"]["output"], out["agent"]["output"]
    assert out["problems"] == [f"the NIXL agent with the LIBFABRIC backend was not created: {out['agent']['output']}"]
