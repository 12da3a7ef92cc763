"""The NIXL check (plugins/modules/epd_transfer_probe.py) follows the vLLM Neuron setup guide, on
the two venv shapes a host can have: nixl 1.5.1 with only its CUDA 12 backend, and the meta
package's full install (nixl-cu12 and nixl-cu13) beside a CUDA 13 torch, as vllm 0.24.0's
torch 2.11.0 from PyPI is.

The NIXL wheels are the real ones (tests/hosts/nixl_wheels.py downloads them before the tests);
torch is a stand-in that carries what nixl and the loader look at: torch/version.py's `cuda` and,
like a CUDA build of torch, the CUDA runtime it loads at import from outside the loader path.
libfabric, libcuda, the CUDA runtime and hwloc are stub libraries (tests/hosts/standins/build.py's
builder) on the module's library_path, each in a directory of its own so a test can leave one off.
The module runs with this machine's loader cache hidden (a private mount namespace): a machine
with a CUDA toolkit in /etc/ld.so.cache would otherwise resolve libcudart.so.13 for ldd, unlike a
trn2 host, whose CUDA runtime comes only with torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.ansible.helpers import REPO
from tests.hosts import nixl_wheels
from tests.hosts.standins import build as standins

pytestmark = [
    pytest.mark.ansible,
    pytest.mark.skipif(
        not nixl_wheels.present(),
        reason=f"no NIXL wheels in {nixl_wheels.WHEELS}: run tests/hosts/wheelhouse.py (needs PyPI once)",
    ),
    pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the NIXL backends in the wheel cache are cp311 wheels"),
]

MODULE = REPO / "plugins/modules/epd_transfer_probe.py"
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
# a libfabric older than the plugin needs: its functions only under FABRIC_1.0/1.1 (Debian
# bookworm's libfabric 1.17 stops at FABRIC_1.6, the plugin needs fi_getinfo@FABRIC_1.10)
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
        patch.setitem(standins.STUBS, "libfabric.so.1", (standins.STUBS["libfabric.so.1"][0], OLD_FABRIC_VERSIONS))
        standins.build_stub("libfabric.so.1", root / "libfabric-old/libfabric.so.1", root)
    return root


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory) -> dict[str, Path]:
    """Each NIXL wheel and numpy (the backends import it) unpacked once: packages, bundled libraries, plugins."""
    root = tmp_path_factory.mktemp("nixl")
    out = {}
    patterns = {dist: nixl_wheels.wheel_glob(dist) for dist in nixl_wheels.DISTRIBUTIONS}
    for dist, pattern in {**patterns, "numpy": nixl_wheels.numpy_glob()}.items():
        wheel = next(nixl_wheels.WHEELS.glob(pattern))
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


def torch_standin(site: Path, cuda: str, preload: bool) -> Path:
    """torch/version.py says which CUDA it was built for; with `preload`, importing it loads that
    CUDA runtime (a stub) from site-packages, off the loader path, as a CUDA build of torch does."""
    major = cuda.split(".")[0]
    runtime = site / f"nvidia/cu{major}/lib/libcudart.so.{major}"
    (site / "torch").mkdir(parents=True)
    (site / "torch/version.py").write_text(f'__version__ = "2.11.0+standin"\ncuda = "{cuda}"\n')
    (site / "torch/__init__.py").write_text(
        '"""STAND-IN torch (epd-kit tests): its CUDA version and the CUDA runtime it loads."""\n'
        "import ctypes\n\nfrom . import version\n\n__version__ = version.__version__\n\n\n"
        "class Tensor:  # nixl 1.3's _api annotates with torch.Tensor at import\n    pass\n\n\n"
        + (f"ctypes.CDLL({str(runtime)!r}, mode=ctypes.RTLD_GLOBAL)\n" if preload else "")
    )
    return runtime


@pytest.fixture(scope="module")
def venv(tmp_path_factory, unpacked, stubs):
    """venv(dists, torch_cuda=None, preload=True) -> its python: the NIXL distributions and numpy
    in its site-packages and, with torch_cuda, the torch stand-in."""
    made: dict[tuple, Path] = {}

    def make(dists: tuple[str, ...], torch_cuda: str | None = None, preload: bool = True) -> Path:
        key = (dists, torch_cuda, preload)
        if key not in made:
            root = tmp_path_factory.mktemp("venv")
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
            site = site_packages(root / "bin/python")
            for dist in (*dists, "numpy"):  # installed as pip lays a wheel out, hard links to the unpacked files
                shutil.copytree(unpacked[dist], site, copy_function=os.link, dirs_exist_ok=True)
            if torch_cuda:
                runtime = torch_standin(site, torch_cuda, preload)
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
    result = subprocess.run([*argv, str(args_file)], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(result.stdout)


def test_a_cu12_only_venv_without_torch_passes_with_the_cuda_12_runtime_on_the_loader_path(venv, stubs):
    # the sandbox's engine venv today: no torch, so nixl falls back to the backend it finds
    python = venv(CU12_ONLY)
    out = probe(python, stubs, libraries=(*HOST_LIBRARIES, "libcudart.so.12"))
    assert out["problems"] == [] and out["notes"] == [], out
    assert out["nixl"]["backend"] == "nixl_cu12" and out["nixl"]["torch"] is None
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
    too_old = [p for p in out["problems"] if "version `FABRIC_1.10' not found" in p]
    assert too_old and "this libfabric is older than the plugin needs" in too_old[0], out["problems"]


def test_a_cuda_13_torch_with_only_nixl_cu12_fails_with_nixls_own_message(venv, stubs):
    out = probe(venv(CU12_ONLY, torch_cuda="13.0"), stubs)
    assert out["problems"] == ["import nixl failed (detected CUDA 13 but nixl-cu13 is not installed)"], out
    assert out["nixl"]["backend"] is None and out["plugin"]["path"] is None


def test_the_agent_probe_imports_torch_first_as_an_engine_does(venv, stubs):
    # libcudart.so.13 only in the process (torch loaded it): the plugin loads and the agent gets as
    # far as the stub libfabric and hwloc let it (no provider, no topology); without torch first
    # NIXL could not load the plugin and would say "unsupported backend 'LIBFABRIC'"
    out = probe(venv(BOTH, torch_cuda="13.0"), stubs, agent=True)
    assert out["agent"]["created"] is False, out
    assert "unsupported backend" not in out["agent"]["output"], out["agent"]["output"]
    assert "backend creation failed for 'LIBFABRIC'" in out["agent"]["output"], out["agent"]["output"]
    assert out["problems"] == [f"the NIXL agent with the LIBFABRIC backend was not created: {out['agent']['output']}"]
