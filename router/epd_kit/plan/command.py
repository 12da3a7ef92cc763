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
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import EpdPlanError
from .neuron_releases import neuron_release
from .values import describe

if TYPE_CHECKING:
    from .settings import Settings

ROLES = ("ve", "pd")
BACKEND_EXECUTABLES = {"vllm": "vllm", "sim": "epd-sim"}


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
PREFIX_CACHING_OFF = "--no-enable-prefix-caching"

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

# Flags the kit derives itself, and the variable an operator changes instead.
MANAGED_FLAGS = {
    "--tensor-parallel-size": "epd_ve_tp / epd_pd_tp",
    "-tp": "epd_ve_tp / epd_pd_tp",
    "--host": "epd_bind_address",
    "--port": "epd_ve_port_base / epd_pd_port_base",
    "--model": "epd_model",
    "--max-model-len": "epd_max_model_len",
    "--max-num-batched-tokens": "epd_max_model_len",
    "--max-num-seqs": "epd_max_num_seqs",
    "--dtype": "epd_quantization",
    "--limit-mm-per-prompt": "epd_images_per_prompt",
    PREFIX_CACHING_OFF: "nothing: it is always set",
    "--no-async-scheduling": "nothing: the kit sets it on every VE",
    "--mm-processor-cache-gb": "nothing: the kit sets it to 0 on every PD",
    "--additional-config": "the epd_* pool variables (docs/planner.md)",
    "--ec-transfer-config": "the epd_* pool variables (docs/planner.md)",
}

# Required, not tuning: without them LIBFABRIC may pick SHM and PD dies with ECLoadFailure.
# the tutorial runs both pools in bfloat16; the router sends VE pixel values in the same dtype
ENGINE_DTYPE = "bfloat16"

EFA_ENVIRONMENT = {"FI_EFA_ENABLE_SHM_TRANSFER": "0", "FI_EFA_USE_DEVICE_RDMA": "1"}

# After the compile budget, vLLM's engine-core wait also covers loading the weights and the NEFFs
# and the warm-up: half of timeouts.START_MARGIN_S (600 s), so vLLM gives up with its own message
# well before the unit's readiness gate (EPD_READY_TIMEOUT_S) and systemd's TimeoutStartSec.
ENGINE_READY_MARGIN_S = 300


def cold_start_timeouts(compilation_timeout_s: int) -> dict[str, str]:
    """Every timeout the sources name for a long first compile, derived from epd_compilation_timeout_s
    (C), so a cold start that the compile budget allows is not cut short by a default (docs/operations.md
    "Timeouts"). aws-neuron-sdk vllm-neuron/docs = V below."""
    budget = str(compilation_timeout_s)
    return {
        # the plugin's compile budget, default 600 s ("can exceed the default 600-second budget",
        # V/tutorials/tutorial-gpt-oss.md; the EPD tutorial exports 6000)
        "VLLM_NEURON_COMPILATION_TIMEOUT": budget,
        # "Seconds to wait for another process to finish compiling before timing out", default 600
        # (V/design/compilation/compilation_cache.md): an engine waiting for its host's other
        # engine compiling the same graph may wait as long as that compile may take. (V/guides/
        # reference-configuration.md reads it as one NEFF's compile timeout: C bounds that too.)
        "NEURON_LIBTORCH_COMPILATION_TIMEOUT": budget,
        # vLLM's bound on each model execution of the multiprocess executor, default 300 s (vLLM
        # envs.py); raised with the compile budget "for large model compilation" (V/tutorials/
        # tutorial-qwen3-vl-32b.md, tutorial-qwen3-embedding-8b.md "Compilation hits the timeout")
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": budget,
        # vLLM's wait for its engine-core processes to be ready, default 600 s (vLLM envs.py,
        # v1/engine/utils.py wait_for_engine_startup); raised "for the disaggregated path"
        # (V/tutorials/tutorial-gpt-oss.md "Compilation hits the timeout", tutorial-di-1p1d-xpyd.md)
        "VLLM_ENGINE_READY_TIMEOUT_S": str(compilation_timeout_s + ENGINE_READY_MARGIN_S),
    }


COLD_START_TIMEOUTS = tuple(cold_start_timeouts(1))
# the vLLM version a simulated engine answers as (epd_kit/sim/release.py), set from the fleet's
# release, so a release change rolls the sims as it would roll vllm (the argv stays vllm's)
SIM_VLLM_VARIABLE = "EPD_SIM_VLLM"
# Environment the kit derives itself; an operator cannot override it per fleet.
MANAGED_ENV = ("NEURON_VISIBLE_DEVICES", *EFA_ENVIRONMENT, *COLD_START_TIMEOUTS, SIM_VLLM_VARIABLE)


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


def ec_transfer_config(role: str, engine_id: str, bind_address: str, side_channel_port: int | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"backends": ["LIBFABRIC"]}
    if role == "ve":
        extra["side_channel_host"] = bind_address
        extra["side_channel_port"] = side_channel_port
    return {
        "ec_connector": "NeuronNixlECConnector",
        "ec_role": "ec_producer" if role == "ve" else "ec_consumer",
        "engine_id": engine_id,
        "ec_connector_extra_config": extra,
    }


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
            "EPD_LIMIT_MM_PER_PROMPT": json.dumps({"image": settings.images_per_prompt}),
            ROLE_ARGS: ROLE_FLAGS[role],
            ADDITIONAL_CONFIG: json.dumps(additional_config(settings, role)),
            EC_TRANSFER_CONFIG: json.dumps(ec_transfer_config(role, engine_id, bind_address, side_channel_port)),
            EXTRA_ARGS: settings.extra_args,
        }
    )


def serve_argv(
    settings: Settings, role: str, engine_id: str, bind_address: str, port: int, side_channel_port: int | None
) -> list[str]:
    """The tutorial's `vllm serve` command, token by token (argv[0] names the backend)."""
    command = engine_command(settings, role, engine_id, bind_address, port, side_channel_port)
    return command.argv(BACKEND_EXECUTABLES[settings.engine_backend])


def engine_env(settings: Settings, cores: Sequence[int]) -> dict[str, str]:
    """The engine's process environment: its core slice, the EFA settings, the cold-start timeouts,
    what the fleet's Neuron release sets (its compile route), and for the sim the vLLM it answers as."""
    release = neuron_release(settings.neuron_release)
    env = {
        "NEURON_VISIBLE_DEVICES": ",".join(str(c) for c in cores),
        **EFA_ENVIRONMENT,
        **cold_start_timeouts(settings.compilation_timeout_s),
        **release.profile()["engine_environment"],
    }
    if settings.engine_backend == "sim":
        env[SIM_VLLM_VARIABLE] = release.vllm
    if settings.model_is_local:
        env["HF_HUB_OFFLINE"] = "1"
    env.update(settings.engine_environment)
    return env


def check_extra_args(args: tuple[str, ...]) -> tuple[str, ...]:
    """Refuse extra argv that would break EPD, override a derived flag, or not survive the unit."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag == "--enable-prefix-caching":
            raise EpdPlanError(
                f"epd_extra_args contains {arg!r}: prefix caching must stay off on both pools "
                "(a KV prefix hit bypasses encoder-input scheduling, so PD answers from stale "
                "blocks without pulling the embedding); remove it"
            )
        if flag == "--mm-encoder-only":
            raise EpdPlanError(
                f"epd_extra_args contains {arg!r}: that gives every PD engine both build roles "
                "(mm_encoder_only and mm_language_model_only are mutually exclusive, vLLM raises "
                "at startup); the kit sets the build role per pool, remove it"
            )
        if flag in ("--mm-language-model-only", "--mm_language_model_only"):
            raise EpdPlanError(
                f"epd_extra_args contains {arg!r}: there is no such vllm flag; the kit puts "
                "mm_language_model_only inside --additional-config of every PD, remove it"
            )
        if flag in MANAGED_FLAGS:
            raise EpdPlanError(
                f"epd_extra_args contains {arg!r}: the kit derives {flag} itself; change "
                f"{MANAGED_FLAGS[flag]} instead of passing it again"
            )
        if not arg or any(ch.isspace() for ch in arg):
            raise EpdPlanError(
                f"epd_extra_args contains {arg!r}, which is empty or contains whitespace: the engine unit "
                "splits extra arguments on whitespace, so pass each argument as its own list item without spaces"
            )
    return args


def check_engine_environment(value: Any) -> tuple[tuple[str, str], ...]:
    """Extra engine environment (e.g. EPD_SIM_* latencies, NEURON_RT_* knobs): argv stays untouched."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise EpdPlanError(f"epd_engine_environment must be a mapping of NAME: value, got {describe(value)}")
    out = []
    for name, item in sorted(value.items()):
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise EpdPlanError(f"epd_engine_environment: {name!r} is not a valid environment variable name")
        if name in COLD_START_TIMEOUTS:
            raise EpdPlanError(
                f"epd_engine_environment sets {name}: the kit derives it from epd_compilation_timeout_s; "
                "change that instead and remove it from the inventory"
            )
        if name in MANAGED_ENV:
            raise EpdPlanError(
                f"epd_engine_environment sets {name}: the kit derives it (core slices, required EFA settings); "
                "remove it from the inventory"
            )
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise EpdPlanError(f"epd_engine_environment[{name}] must be a string or number, got {describe(item)}")
        text = str(item)
        if "\n" in text:
            raise EpdPlanError(f"epd_engine_environment[{name}] must be a single line")
        out.append((name, text))
    return tuple(out)
