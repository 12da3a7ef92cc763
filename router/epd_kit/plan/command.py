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

from .errors import EpdPlanError
from .managed import EFA_ENVIRONMENT, PREFIX_CACHING_OFF, SIM_VLLM_VARIABLE, cold_start_timeouts
from .neuron_releases import neuron_release

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
            # the pool's flags, then those the fleet's release's vLLM needs on every engine the router calls
            ROLE_ARGS: ROLE_FLAGS[role] + neuron_release(settings.neuron_release).serve_flags(),
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
    return command.argv(settings.executable)


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
        env[SIM_VLLM_VARIABLE] = ".".join(release.vllm.split(".")[:2])  # "0.29": the series the wire follows
    if settings.model_is_local:
        env["HF_HUB_OFFLINE"] = "1"
    env.update(settings.engine_environment)
    return env
