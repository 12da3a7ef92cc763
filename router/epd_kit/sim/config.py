"""From `vllm serve` flags + environment to a validated engine configuration.

Startup checks raise `StartupFailure` carrying the exception type and message the real
engine prints (docs/contract.md §7.2, tutorial "Common issues"), so logs read the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epd_kit.plan import EFA_ENVIRONMENT
from epd_kit.plan.command import Role
from epd_kit.plan.neuron_releases import DEFAULT_RELEASE, neuron_release

from .checkpoint import (
    VLLM_DEFAULT_ARCH,
    VLLM_DEFAULT_MODEL,
    CheckpointError,
    CheckpointInfo,
    VisionGeometry,
    VocabSpace,
    load_checkpoint,
)

# the vLLM version epd-sim answers as (`/version`, its start line): the default Neuron release's
VLLM_VERSION = str(neuron_release(DEFAULT_RELEASE).engine_venv["vllm"].version)

_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
# what the engine refuses to start without (set by the kit in one place: epd_kit.plan)
EFA_REQUIRED = EFA_ENVIRONMENT
DEFAULT_SIDE_CHANNEL_HOST = "127.0.0.1"
DEFAULT_TRANSFER_TIMEOUT_S = 1.0
DEFAULT_MIN_HOLD_MS_EPD = 100.0


class StartupFailure(Exception):
    """A fatal error before the engine is ready: `exc_type: message`, then exit 1."""

    def __init__(self, exc_type: str, message: str) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message

    def __str__(self) -> str:
        return f"{self.exc_type}: {self.message}"


@dataclass(frozen=True)
class ServeArgs:
    """The `vllm serve` flags the kit renders, as parsed (JSON flags already decoded)."""

    model: str | None
    tensor_parallel_size: int = 1
    host: str | None = None
    port: int = 8000
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    dtype: str = "auto"
    limit_mm_per_prompt: dict[str, Any] = field(default_factory=dict)
    enable_prefix_caching: bool | None = None
    mm_encoder_only: bool = False
    async_scheduling: bool | None = None
    mm_processor_cache_gb: float | None = None
    additional_config: dict[str, Any] = field(default_factory=dict)
    ec_transfer_config: dict[str, Any] = field(default_factory=dict)
    served_model_name: str | None = None
    # --api-key (vLLM: one or more; logged with the other non-default args, as vLLM does: the
    # kit passes the key through VLLM_API_KEY instead, docs/security.md "Engine keys")
    api_key: list[str | None] | None = None
    # --otlp-traces-endpoint: the collector spans go to (tracing.py); None: tracing off
    otlp_traces_endpoint: str | None = None
    # --enable-scale-out (vLLM >= 0.30, entrypoints/launchers/cli_args.py): serve the scale-out
    # routes, /inference/v1/generate among them (release.py SCALE_OUT_DISABLED without it)
    enable_scale_out: bool = False


@dataclass(frozen=True)
class EngineConfig:
    role: Role
    model: str
    served_model_name: str
    checkpoint: CheckpointInfo
    tp: int
    host: str
    port: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    dtype_bytes: int
    enable_prefix_caching: bool
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    transfer_timeout_s: float
    vision_attention_block_size: int
    max_vision_tokens: int  # max(num_vision_tokens_buckets): raw patches per VE request
    vision_dp: int
    encoder_cache_num_blocks: int
    encoder_cache_min_hold_s: float
    visible_cores: tuple[int, ...] | None
    efa_env_ok: bool
    warnings: tuple[str, ...] = ()
    enable_scale_out: bool = False  # --enable-scale-out

    @property
    def vision(self) -> VisionGeometry:
        return self.checkpoint.vision

    @property
    def vocab(self) -> VocabSpace:
        return self.checkpoint.vocab

    @property
    def block_tokens(self) -> int:
        """Embedding rows per encoder-cache block (vision_attention_block_size / merge)."""
        return self.vision_attention_block_size // self.vision.merge_factor

    @property
    def block_len(self) -> int:
        """Bytes per encoder-cache block, as the NIXL handshake advertises it (docs/contract.md §2.4)."""
        return self.block_tokens * self.vision.fat_dim * self.dtype_bytes

    @property
    def slice_misaligned(self) -> bool:
        return bool(self.visible_cores) and self.visible_cores[0] % self.tp != 0


def parse_visible_devices(value: str) -> tuple[int, ...]:
    """`0,1,2,3` or `8-11` or a mix; order kept."""
    cores: list[int] = []
    for part in value.replace(" ", "").split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cores.extend(range(int(lo), int(hi) + 1))
        else:
            cores.append(int(part))
    return tuple(cores)


def _role(args: ServeArgs) -> Role:
    lm_only = args.additional_config.get("mm_language_model_only") is True
    ec_role = args.ec_transfer_config.get("ec_role")
    if args.mm_encoder_only and lm_only:
        raise StartupFailure(
            "ValueError",
            "mm_encoder_only and mm_language_model_only are mutually exclusive: an engine "
            "builds either the vision tower only (VE, --mm-encoder-only) or the language "
            "model only (PD, additional_config.mm_language_model_only), not both.",
        )
    if args.mm_encoder_only:
        if ec_role not in (None, "ec_producer"):
            raise StartupFailure("ValueError", f"--mm-encoder-only needs ec_role 'ec_producer', got {ec_role!r}")
        return "ve"
    if lm_only:
        if ec_role not in (None, "ec_consumer"):
            raise StartupFailure(
                "ValueError",
                f"mm_language_model_only needs ec_role 'ec_consumer', got {ec_role!r}",
            )
        return "pd"
    raise StartupFailure(
        "ValueError",
        "epd-sim simulates disaggregated engines only: pass --mm-encoder-only (VE, "
        'ec_role ec_producer) or put "mm_language_model_only": true at the top level of '
        "--additional-config (PD, ec_role ec_consumer). A mm_language_model_only nested "
        "inside another dict is ignored, as in vLLM.",
    )


def _text_only_error(arch: str) -> StartupFailure:
    """A text-only architecture built with a vision_neuron_config (tutorial, Common issues)."""
    return StartupFailure("TypeError", f"{arch}.from_configs() got an unexpected keyword argument 'text_neuron_config'")


def _checkpoint(args: ServeArgs, vision_cfg: dict[str, Any]) -> tuple[str, CheckpointInfo, list[str]]:
    """Resolve the model like vLLM: no/empty argument -> the text-only default model."""
    warnings: list[str] = []
    model = args.model or ""
    if not model:
        warnings.append(
            f"No model argument given: vLLM falls back to its default {VLLM_DEFAULT_MODEL} "
            '(text-only). Quote "$MODEL" and check it is set.'
        )
        model = VLLM_DEFAULT_MODEL
    path = Path(model)
    if not path.is_dir():
        if vision_cfg:
            warnings.append(
                f"model {model!r} is not a local checkpoint directory; resolved as the "
                f"text-only {VLLM_DEFAULT_ARCH} (is $MODEL set and the path right?)"
            )
            raise _text_only_error(VLLM_DEFAULT_ARCH)
        raise StartupFailure(
            "OSError",
            f"model {model!r} is not a local checkpoint directory; epd-sim serves local "
            "checkpoints only (use HF_HUB_OFFLINE=1 with a downloaded checkpoint)",
        )
    try:
        info = load_checkpoint(path)
    except CheckpointError as exc:
        raise StartupFailure("OSError", f"cannot load model {model!r}: {exc}") from exc
    if vision_cfg and not info.is_multimodal:
        raise _text_only_error(info.architecture)
    return model, info, warnings


def _int(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or value <= 0:
        raise StartupFailure("ValueError", f"{key} must be a positive integer, got {value!r}")
    return value


def build_engine_config(args: ServeArgs, env: Mapping[str, str]) -> EngineConfig:
    role = _role(args)
    additional = args.additional_config
    vision_cfg = additional.get("vision_neuron_config") or {}
    if not isinstance(vision_cfg, dict):
        raise StartupFailure("ValueError", "vision_neuron_config must be a JSON object")
    model, info, warnings = _checkpoint(args, vision_cfg)

    visible = None
    raw_visible = env.get("NEURON_VISIBLE_DEVICES")
    if raw_visible:
        try:
            visible = parse_visible_devices(raw_visible)
        except ValueError as exc:
            raise StartupFailure("ValueError", f"NEURON_VISIBLE_DEVICES={raw_visible!r} is not a core list") from exc
    tp = args.tensor_parallel_size
    if tp < 1:
        raise StartupFailure("ValueError", f"--tensor-parallel-size must be >= 1, got {tp}")
    if visible is not None and tp != len(visible):
        raise StartupFailure(
            "AssertionError",
            f"TP ({tp}) != len(NEURON_VISIBLE_DEVICES) ({len(visible)}): "
            f"NEURON_VISIBLE_DEVICES={raw_visible} has {len(visible)} cores but "
            f"--tensor-parallel-size is {tp}",
        )

    max_model_len = args.max_model_len or 8192
    mnbt = args.max_num_batched_tokens or max_model_len
    max_num_seqs = args.max_num_seqs or (1 if role == "ve" else 256)
    vab = _int(vision_cfg, "vision_attention_block_size", 1024)
    buckets = vision_cfg.get("num_vision_tokens_buckets") or [max_model_len]
    if not (isinstance(buckets, list) and all(isinstance(b, int) and b > 0 for b in buckets)):
        raise StartupFailure("ValueError", "num_vision_tokens_buckets must be a list of ints")

    geometry = info.vision
    if vab % geometry.merge_factor:
        raise StartupFailure(
            "ValueError",
            f"vision_attention_block_size={vab} must be a multiple of the merge factor {geometry.merge_factor}",
        )
    block_tokens = vab // geometry.merge_factor
    configured_blocks = _int(vision_cfg, "encoder_cache_num_blocks", 128)
    # The configured value is a floor raised to the scheduler-derived minimum (docs/contract.md §7.2).
    minimum = math.ceil(max(mnbt, block_tokens) / block_tokens) + 1
    num_blocks = configured_blocks
    if configured_blocks < minimum:
        warnings.append(
            f"encoder_cache_num_blocks={configured_blocks} is too small for "
            f"max_num_batched_tokens={mnbt}; raised to {minimum}"
        )
        num_blocks = minimum

    ec = args.ec_transfer_config
    extra = ec.get("ec_connector_extra_config") or {}
    engine_id = str(ec.get("engine_id") or f"epd-sim-{role}-{args.port}")
    side_port = int(extra.get("side_channel_port") or 0)
    hold_ms = float(vision_cfg.get("encoder_cache_min_hold_time_ms", DEFAULT_MIN_HOLD_MS_EPD))

    return EngineConfig(
        role=role,
        model=model,
        served_model_name=args.served_model_name or model,
        checkpoint=info,
        tp=tp,
        host=args.host or "0.0.0.0",
        port=args.port,
        max_model_len=max_model_len,
        max_num_batched_tokens=mnbt,
        max_num_seqs=max_num_seqs,
        dtype_bytes=_DTYPE_BYTES.get(args.dtype, 2),
        # Prefix caching is ON unless --no-enable-prefix-caching is passed (vLLM default).
        enable_prefix_caching=args.enable_prefix_caching is not False,
        engine_id=engine_id,
        side_channel_host=str(extra.get("side_channel_host") or DEFAULT_SIDE_CHANNEL_HOST),
        side_channel_port=side_port,
        transfer_timeout_s=float(extra.get("transfer_timeout_sec", DEFAULT_TRANSFER_TIMEOUT_S)),
        vision_attention_block_size=vab,
        max_vision_tokens=max(buckets),
        vision_dp=_int(vision_cfg, "dp_size", 1),
        encoder_cache_num_blocks=num_blocks,
        encoder_cache_min_hold_s=hold_ms / 1000.0,
        visible_cores=visible,
        efa_env_ok=all(env.get(k) == v for k, v in EFA_REQUIRED.items()),
        warnings=tuple(warnings),
        enable_scale_out=args.enable_scale_out,
    )
