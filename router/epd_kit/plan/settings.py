"""Fleet-wide pool settings (group_vars/all): validated values plus what is derived from them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .backends import PROFILES, EngineProfile, backend_profile
from .defaults import GLOBAL_DEFAULTS
from .errors import EpdPlanError
from .managed import check_engine_environment, check_extra_args
from .models import ModelSpec, read_models
from .neuron_releases import DEFAULT_RELEASE, VLLM_CPU_VERSIONS, neuron_release
from .values import ID_PART, as_int, as_str, as_str_list, is_power_of_two
from .variables import VARIABLES

# the fleet's Neuron release (epd_common's, not a pool setting): the engines' environment follows it
RELEASE_VARIABLE = "epd_neuron_release"

# the executable of each epd_engine_backend (its argv is `<executable> serve ...` either way): its profile's
BACKEND_EXECUTABLES = {name: profile.executable for name, profile in PROFILES.items()}
QUANTIZATIONS = VARIABLES["epd_quantization"].choices  # the one list: variables.py
MIN_PORT = 1024  # the engines' and the router's ports (MAX_PORT: variables.py)
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
# A hub id is owner/name; an owner that is a usual directory name means a relative path.
DIRECTORY_NAMES = frozenset(
    {
        "models",
        "model",
        "checkpoints",
        "checkpoint",
        "ckpt",
        "weights",
        "data",
        "home",
        "opt",
        "mnt",
        "srv",
        "tmp",
        "var",
    }
)


@dataclass(frozen=True)
class Settings:
    """Fleet-wide pool settings (group_vars/all), validated, plus derived values."""

    model: str
    quantization: str
    modules_to_not_convert: tuple[str, ...]
    engine_backend: str
    ve_tp: int
    ve_dp: int
    pd_tp: int
    max_model_len: int
    max_num_seqs: int
    images_per_prompt: int
    image_edge: int
    patch_size: int
    encoder_cache_num_blocks: int
    ve_port_base: int
    pd_port_base: int
    side_channel_port_base: int
    router_port: int
    engine_id_prefix: str
    start_stagger_s: int
    compilation_timeout_s: int
    start_timeout_s: int | None
    extra_args: tuple[str, ...]
    engine_environment: tuple[tuple[str, str], ...] = ()
    neuron_release: str = DEFAULT_RELEASE
    vllm_cpu_ec_dir: str = str(VARIABLES["epd_vllm_cpu_ec_dir"].default)
    vllm_cpu_vllm: str | None = None  # epd_vllm_cpu_vllm; None: the release's vLLM (engine_vllm)
    vllm_cpu_ec_transport: str = str(VARIABLES["epd_vllm_cpu_ec_transport"].default)
    vllm_cpu_ucx_port_range: str = str(VARIABLES["epd_vllm_cpu_ucx_port_range"].default)
    otlp_traces_endpoint: str = ""
    # the epd_models entries (models.py); with this one as models[0]: models.fleet_models
    models: tuple[ModelSpec, ...] = ()

    @property
    def model_is_local(self) -> bool:
        return self.model.startswith("/")

    @property
    def vision_attention_block_size(self) -> int:
        """Patches per image: (edge/patch)²; the same on both pools by construction."""
        return (self.image_edge // self.patch_size) ** 2

    @property
    def vision_tokens_bucket(self) -> int:
        """images × (edge/patch)², e.g. 30 × (512/16)² = 30720."""
        return self.images_per_prompt * self.vision_attention_block_size

    @property
    def profile(self) -> EngineProfile:
        """The fleet's engine backend profile with its knobs (backends.py)."""
        return EngineProfile(
            backend=backend_profile(self.engine_backend),
            release_vllm=neuron_release(self.neuron_release).vllm,
            vllm_choice=self.vllm_cpu_vllm,
            ec_transport=self.vllm_cpu_ec_transport,
            ucx_port_range=self.vllm_cpu_ucx_port_range,
            ec_dir=self.vllm_cpu_ec_dir,
        )

    @property
    def executable(self) -> str:
        """argv[0] of every engine: the backend's executable name."""
        return self.profile.backend.executable

    @property
    def engine_vllm(self) -> str:
        """The vLLM version the engines run (EngineProfile.vllm)."""
        return self.profile.vllm

    @property
    def handoff(self) -> str:
        """How the fleet's VEs hand encoder outputs to its PDs (router.yaml `handoff`)."""
        return self.profile.handoff

    @property
    def front_checks(self) -> str:
        """Whose chat front's context checks the router repeats (router.yaml `front_checks`)."""
        return self.profile.front_checks

    @property
    def ec_read_failure(self) -> str:
        """How a PD's failed read of an item reaches the router (router.yaml `ec_read_failure`):
        with vllm-cpu's NIXL transport the request alone ends as vLLM's generation error, its
        engine living on (the kit's connector at 0.24/0.29: engine_plugin scheduler.py ends it
        FINISHED_ERROR; upstream's at 0.32.0: v1/core/sched/scheduler.py take_unavailable_requests);
        otherwise the PD's engine core dies (vllm-neuron, docs/contract.md §3.5; the shared
        directory's connector raises in the worker)."""
        return self.profile.ec_read_failure

    def tp(self, role: str) -> int:
        return self.ve_tp if role == "ve" else self.pd_tp

    def as_dict(self) -> dict[str, Any]:
        """Resolved settings with the inventory names, plus the derived values."""
        out: dict[str, Any] = {}
        for key in GLOBAL_DEFAULTS:
            value = getattr(self, key.removeprefix("epd_"))
            if key == "epd_engine_environment":
                value = dict(value)
            elif key == "epd_models":
                value = [m.as_dict() for m in value]
            out[key] = list(value) if isinstance(value, tuple) else value
        out["model_is_local"] = self.model_is_local
        out["vision_attention_block_size"] = self.vision_attention_block_size
        out["vision_tokens_bucket"] = self.vision_tokens_bucket
        out["executable"] = self.executable
        out[RELEASE_VARIABLE] = self.neuron_release
        return out


def check_model(value: Any) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise EpdPlanError(
            "epd_model is unset or empty: set it in group_vars/all to a local checkpoint directory "
            "(preferred, e.g. /models/Qwen3-VL-32B-Instruct) or a Hugging Face id; without it "
            "vllm serve silently falls back to a text-only default model"
        )
    model = as_str("epd_model", value).strip()
    if model.startswith("/"):
        return model
    if model.startswith((".", "~")):
        raise EpdPlanError(
            f"epd_model {model!r} is a relative path: engines run on other hosts under systemd, "
            "so give the absolute checkpoint directory"
        )
    owner = model.split("/", 1)[0] if "/" in model else ""
    if owner.lower() in DIRECTORY_NAMES:
        raise EpdPlanError(
            f"epd_model {model!r} looks like a relative path ({owner}/ is a directory name, not a hub "
            f"owner): give the absolute checkpoint directory, e.g. /{model}"
        )
    if not HUB_ID.fullmatch(model):
        raise EpdPlanError(
            f"epd_model {model!r} is neither an absolute checkpoint directory nor a Hugging Face "
            "id like Qwen/Qwen3-VL-32B-Instruct"
        )
    return model


def vllm_cpu_version(value: Any) -> str | None:
    """epd_vllm_cpu_vllm: unset (None), or a vLLM version that has a lock list."""
    if value is None:
        return None
    version = as_str("epd_vllm_cpu_vllm", value).strip()
    if version not in VLLM_CPU_VERSIONS:
        raise EpdPlanError(
            f"epd_vllm_cpu_vllm must be one of {', '.join(VLLM_CPU_VERSIONS)} (the vLLM versions with a lock "
            f"list {PROFILES['vllm-cpu'].lock_lists}/requirements-vllm-<version>.txt), got {version!r}; unset, "
            "the Neuron release's"
        )
    return version


def declared_int(name: str, value: Any) -> int:
    """`value` as an integer within the bounds variables.py declares for `name` (one home for them)."""
    var = VARIABLES[name]
    bound = [None if b is None else int(b) for b in (var.minimum, var.maximum)]
    return as_int(name, value, minimum=bound[0], maximum=bound[1])


def check_port_range(key: str, value: str) -> str:
    """A "first-last" port range (1024-65535, first <= last), as UCX_TCP_PORT_RANGE takes it."""
    found = re.fullmatch(r"(\d+)-(\d+)", value)
    if not found or not 1024 <= int(found[1]) <= int(found[2]) <= 65535:
        raise EpdPlanError(
            f"{key} must be a port range 'first-last' within 1024-65535, e.g. 14700-14763; got {value!r}"
        )
    return value


def port_range(value: str) -> range:
    first, last = value.split("-")
    return range(int(first), int(last) + 1)


def read_settings(variables: Mapping[str, Any]) -> Settings:
    """Validate the fleet-wide settings; missing keys take GLOBAL_DEFAULTS."""

    def get(key: str) -> Any:
        return variables[key] if key in variables and variables[key] is not None else GLOBAL_DEFAULTS[key]

    quantization = as_str("epd_quantization", get("epd_quantization"))
    if quantization not in QUANTIZATIONS:
        raise EpdPlanError(f"epd_quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    backend = backend_profile(as_str("epd_engine_backend", get("epd_engine_backend")))
    transport = as_str("epd_vllm_cpu_ec_transport", get("epd_vllm_cpu_ec_transport"))
    if transport not in VARIABLES["epd_vllm_cpu_ec_transport"].choices:
        raise EpdPlanError(f"epd_vllm_cpu_ec_transport must be shared-dir or nixl, got {transport!r}")
    cpu_vllm = vllm_cpu_version(get("epd_vllm_cpu_vllm"))
    release = neuron_release(variables.get(RELEASE_VARIABLE) or DEFAULT_RELEASE)
    refused = EngineProfile(backend, release.vllm, cpu_vllm, transport).refusals(quantization)
    if refused:
        raise EpdPlanError(refused[0])
    tps = {}
    for key in ("epd_ve_tp", "epd_pd_tp"):
        tps[key] = declared_int(key, get(key))
        if not is_power_of_two(tps[key]):
            raise EpdPlanError(
                f"{key} must be a power of two (1, 2, 4, 8, 16, 32, 64): trn2 tensor-parallel "
                f"groups map onto aligned core blocks, got {tps[key]}"
            )
    ve_dp = declared_int("epd_ve_dp", get("epd_ve_dp"))
    if tps["epd_ve_tp"] % ve_dp:
        raise EpdPlanError(
            f"epd_ve_dp ({ve_dp}) must divide epd_ve_tp ({tps['epd_ve_tp']}): the vision encoder "
            "runs dp_size data-parallel replicas inside the VE's cores"
        )
    edge = declared_int("epd_image_edge", get("epd_image_edge"))
    patch = declared_int("epd_patch_size", get("epd_patch_size"))
    if edge % patch:
        raise EpdPlanError(
            f"epd_image_edge ({edge}) must be a multiple of epd_patch_size ({patch}), "
            f"e.g. {edge // patch * patch or patch}"
        )
    prefix = as_str("epd_engine_id_prefix", get("epd_engine_id_prefix"))
    if not ID_PART.fullmatch(prefix):
        raise EpdPlanError(f"epd_engine_id_prefix must be letters, digits, '.', '_' or '-', got {prefix!r}")
    modules = as_str_list("epd_modules_to_not_convert", get("epd_modules_to_not_convert"))
    settings = Settings(
        model=check_model(variables.get("epd_model") if "epd_model" in variables else None),
        quantization=quantization,
        modules_to_not_convert=modules,
        engine_backend=backend.backend,
        ve_tp=tps["epd_ve_tp"],
        ve_dp=ve_dp,
        pd_tp=tps["epd_pd_tp"],
        max_model_len=declared_int("epd_max_model_len", get("epd_max_model_len")),
        max_num_seqs=declared_int("epd_max_num_seqs", get("epd_max_num_seqs")),
        images_per_prompt=declared_int("epd_images_per_prompt", get("epd_images_per_prompt")),
        image_edge=edge,
        patch_size=patch,
        encoder_cache_num_blocks=declared_int("epd_encoder_cache_num_blocks", get("epd_encoder_cache_num_blocks")),
        ve_port_base=declared_int("epd_ve_port_base", get("epd_ve_port_base")),
        pd_port_base=declared_int("epd_pd_port_base", get("epd_pd_port_base")),
        side_channel_port_base=declared_int("epd_side_channel_port_base", get("epd_side_channel_port_base")),
        router_port=declared_int("epd_router_port", get("epd_router_port")),
        engine_id_prefix=prefix,
        start_stagger_s=declared_int("epd_start_stagger_s", get("epd_start_stagger_s")),
        compilation_timeout_s=declared_int("epd_compilation_timeout_s", get("epd_compilation_timeout_s")),
        start_timeout_s=None
        if get("epd_start_timeout_s") is None
        else declared_int("epd_start_timeout_s", get("epd_start_timeout_s")),
        extra_args=check_extra_args(as_str_list("epd_extra_args", get("epd_extra_args"))),
        engine_environment=check_engine_environment(get("epd_engine_environment")),
        neuron_release=release.name,
        vllm_cpu_ec_dir=as_str("epd_vllm_cpu_ec_dir", get("epd_vllm_cpu_ec_dir")),
        vllm_cpu_vllm=cpu_vllm,
        vllm_cpu_ec_transport=transport,
        vllm_cpu_ucx_port_range=check_port_range(
            "epd_vllm_cpu_ucx_port_range", as_str("epd_vllm_cpu_ucx_port_range", get("epd_vllm_cpu_ucx_port_range"))
        ),
        otlp_traces_endpoint=as_str("epd_otlp_traces_endpoint", get("epd_otlp_traces_endpoint") or ""),
    )
    models = read_models(variables, settings, read_settings)
    return replace(settings, models=models) if models else settings
