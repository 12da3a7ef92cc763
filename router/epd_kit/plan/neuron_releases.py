"""The Neuron releases the kit supports: one table per release, each line with its source.

provision.yml installs what the selected release (`epd_neuron_release`) lists, and only that:
the Neuron system packages, the EFA installer, and the engine venv's requirement set, which is
generated from `engine_venv` (a pin the release does not list can only come in through
`epd_provision_engine_extra_requirements`, on the operator's word). docs/provisioning.md shows
the table (tests/unit/plan/test_neuron_releases.py keeps the two equal).

Sources, abbreviated in the table:
- manifest: aws-neuron/aws-neuron-sdk `src/helperscripts/n2-manifest.json`, the release's
  `"neuron_version"` entry (verbatim version strings)
- manual: aws-neuron/aws-neuron-sdk `setup/pytorch/manual.rst` (Neuron 2.32 versions, commit
  10ea9cac of 2026-08-18)
- METADATA: the wheel's own `Requires-Dist` (the PyPI wheel; for the Neuron pip repository's
  wheels, which are out of reach here, the source named on the line)
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import EpdPlanError


@dataclass(frozen=True)
class Pin:
    """One version and where it comes from."""

    version: str
    source: str


@dataclass(frozen=True)
class NeuronRelease:
    """What one Neuron release installs on an engine host."""

    name: str
    system: dict[str, Pin]  # apt package -> version (installed as <version>*)
    efa_installer: Pin
    engine_venv: dict[str, Pin]  # pip distribution -> version, the venv's whole requirement set
    python: tuple[str, str]  # oldest and newest supported Python minor
    python_source: str
    os: tuple[str, ...]  # "<distribution> <version>" the release installs on
    os_source: str
    notes: tuple[str, ...] = ()

    def profile(self) -> dict:
        """The plain-data form the roles read (`epd.kit.epd_neuron_release`)."""
        return {
            "name": self.name,
            "system": {package: pin.version for package, pin in self.system.items()},
            "efa_installer": self.efa_installer.version,
            "engine_venv": {dist: pin.version for dist, pin in self.engine_venv.items()},
            "python_min": self.python[0],
            "python_max": self.python[1],
            "os": list(self.os),
        }

    def table(self) -> list[tuple[str, str, str]]:
        """(component, version, source) rows, as docs/provisioning.md shows them."""
        rows = [(f"`{package}`", pin.version, pin.source) for package, pin in self.system.items()]
        rows.append(("EFA installer", self.efa_installer.version, self.efa_installer.source))
        rows += [(f"`{dist}` (engine venv)", pin.version, pin.source) for dist, pin in self.engine_venv.items()]
        rows.append(("Python", f"{self.python[0]} to {self.python[1]}", self.python_source))
        rows.append(("operating system", ", ".join(self.os), self.os_source))
        return rows


_M232 = 'manifest 2.32.0: `{{"name":"{}","version":"{}"}}`'
# vllm-neuron 0.24.0.1.1.0's requirements/core.txt (its pyproject.toml reads its dependencies
# from it): the copy read is in a fork of vllm-project/vllm-neuron at that version, the upstream
# repository's tags stop at 0.2.0 and the Neuron pip repository is out of reach here
_CORE = "vllm-neuron 0.24.0.1.1.0 requirements/core.txt: `{}`"

NEURON_2_32 = NeuronRelease(
    name="2.32.0",
    system={
        "aws-neuronx-dkms": Pin("2.30.2.0", _M232.format("aws-neuronx-dkms", "2.30.2.0") + "; manual: `=2.30.2.0*`"),
        "aws-neuronx-runtime-lib": Pin("2.34.10.0", _M232.format("aws-neuronx-runtime-lib", "2.34.10.0")),
        "aws-neuronx-collectives": Pin("2.34.10.0", _M232.format("aws-neuronx-collectives", "2.34.10.0")),
        "aws-neuronx-tools": Pin("2.32.28.0", _M232.format("aws-neuronx-tools", "2.32.28.0")),
    },
    # the manifest says "1.47" (no patch level) and every doc downloads aws-efa-installer-latest;
    # the kit pins a versioned tarball, and no source read names 1.47's patch level: 1.47.0
    efa_installer=Pin("1.47.0", 'manifest 2.32.0: `{"name":"efa-installer","version":"1.47"}`; patch level .0 assumed'),
    engine_venv={
        "vllm-neuron": Pin("0.24.0.1.1.0", _M232.format("vllm-neuron", "0.24.0.1.1.0")),
        "vllm": Pin("0.24.0", _CORE.format("vllm==0.24.0") + "; vllm 0.24.0 METADATA: `Requires-Dist: torch==2.11.0`"),
        # core.txt leaves it unpinned ("to resolve based on vLLM's torch requirement"); of the
        # two builds the manifest lists (torch 2.11 and 2.12), the one for vllm's torch 2.11.0
        "libtorch-neuronx-lite": Pin(
            "2.11.0.1.0.1284",
            _M232.format("libtorch_neuronx_lite", "2.11.0.1.0.1284") + "; " + _CORE.format("libtorch-neuronx-lite"),
        ),
        # the setup guide: the compiler and NKI "are not included and must be installed separately"
        "neuronx-cc": Pin("2.27.5334.0", _M232.format("neuronx-cc", "2.27.5334.0")),
        "nki": Pin("0.6.0", _M232.format("nki", "0.6.0")),
        "nixl": Pin("1.3.2", _CORE.format("nixl==1.3.2") + " (not in the manifest)"),
    },
    python=("3.11", "3.13"),
    python_source=(
        'manifest 2.32.0: `"supported_python_versions":["3.11","3.12","3.13"]`; '
        'manual: "Python 3.11, 3.12 or 3.13"; setup guide: "Python 3.11 or later"'
    ),
    os=("Ubuntu 24.04", "Ubuntu 22.04"),
    os_source=(
        'manual: `:os: ubuntu-24.04, ubuntu-22.04, al2023`; Ubuntu 22.04 "has reached end-of-support on Neuron"; '
        'Amazon Linux 2023 has no vLLM (dlami.rst: "the vLLM environment is also not available on AL2023 DLAMIs")'
    ),
    notes=(
        'torch-neuronx is not part of 2.32.0 (manual: "torch-neuronx (PyTorch/XLA) is not included in Neuron 2.32.0")',
    ),
)

RELEASES: dict[str, NeuronRelease] = {release.name: release for release in (NEURON_2_32,)}
DEFAULT_RELEASE = "2.32.0"


def neuron_release(name: str) -> NeuronRelease:
    """The release called `name`, or an error that lists the supported ones."""
    try:
        return RELEASES[str(name)]
    except KeyError:
        raise EpdPlanError(
            f"epd_neuron_release {name!r} is not a Neuron release the kit supports; supported: "
            f"{', '.join(RELEASES)} (docs/provisioning.md has each release's table)"
        ) from None


def release_profile(name: str) -> dict:
    """`epd.kit.epd_neuron_release`: the release's pins as plain data."""
    return neuron_release(name).profile()


def engine_requirements(name: str, pins: dict | None = None, extra: list | None = None) -> list[str]:
    """`epd.kit.epd_engine_requirements`: the engine venv's requirement set, `name==version` for
    the release's set with the operator's `pins` (epd_provision_engine_pins) over it, then the
    `extra` requirements (epd_provision_engine_extra_requirements) as given."""
    versions = neuron_release(name).profile()["engine_venv"] | dict(pins or {})
    return [f"{dist}=={version}" for dist, version in versions.items()] + [str(r) for r in extra or []]


def markdown_table(name: str) -> str:
    """docs/provisioning.md's table of one release."""
    lines = ["| component | version | source |", "|---|---|---|"]
    lines += [f"| {component} | {version} | {source} |" for component, version, source in neuron_release(name).table()]
    return "\n".join(lines)
