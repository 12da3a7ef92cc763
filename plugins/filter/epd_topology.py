"""epd_topology: the trn2 topology planner of epd-kit (an Ansible filter plugin in plain Python).

This is the only place where NeuronCore slices, ports, engine ids and the exact `vllm serve`
argv are derived. Roles, playbooks and tests all call it; docs/planner.md explains the rules
and docs/architecture.md ("Planner output") fixes the output schema.

Everything above `FilterModule` is plain Python (no Ansible import), so the tests load this
file by path and call the functions directly.
"""

import ipaddress
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("ve", "pd")

# Defaults of every variable the planner reads. Role defaults and argument specs must agree
# with these; `epd_settings` exposes them to playbooks that run without the roles.
GLOBAL_DEFAULTS: dict[str, Any] = {
    "epd_model": None,
    "epd_quantization": "bf16",
    "epd_modules_to_not_convert": [],
    "epd_engine_backend": "vllm",
    "epd_ve_tp": 4,
    "epd_ve_dp": 4,
    "epd_pd_tp": 8,
    "epd_max_model_len": 8192,
    "epd_max_num_seqs": 8,
    "epd_images_per_prompt": 30,
    "epd_image_edge": 512,
    "epd_patch_size": 16,
    "epd_encoder_cache_num_blocks": 128,
    "epd_ve_port_base": 18300,
    "epd_pd_port_base": 18100,
    "epd_side_channel_port_base": 14600,
    "epd_router_port": 18800,
    "epd_engine_id_prefix": "epd",
    "epd_start_stagger_s": 10,
    "epd_compilation_timeout_s": 6000,
    "epd_extra_args": [],
    "epd_engine_environment": {},
}
HOST_DEFAULTS: dict[str, Any] = {
    "epd_num_ve": 0,
    "epd_num_pd": 0,
    "epd_core_count": 64,
    "epd_excluded_cores": [],
    "epd_slices": None,
    "epd_bind_address": "127.0.0.1",
}

QUANTIZATIONS = ("bf16", "mxfp8")
BACKEND_EXECUTABLES = {"vllm": "vllm", "sim": "epd-sim"}
MIN_PORT, MAX_PORT = 1024, 65535

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
    "--no-enable-prefix-caching": "nothing: it is always set",
    "--no-async-scheduling": "nothing: the kit sets it on every VE",
    "--mm-processor-cache-gb": "nothing: the kit sets it to 0 on every PD",
    "--additional-config": "the epd_* pool variables (docs/planner.md)",
    "--ec-transfer-config": "the epd_* pool variables (docs/planner.md)",
}
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


class EpdPlanError(ValueError):
    """The inventory cannot be planned; the message says what to change."""


# --------------------------------------------------------------------------- input models


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
    extra_args: tuple[str, ...]
    engine_environment: tuple[tuple[str, str], ...] = ()

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

    def tp(self, role: str) -> int:
        return self.ve_tp if role == "ve" else self.pd_tp

    def as_dict(self) -> dict[str, Any]:
        """Resolved settings with the inventory names, plus the derived values."""
        out: dict[str, Any] = {}
        for key in GLOBAL_DEFAULTS:
            value = getattr(self, key.removeprefix("epd_"))
            if key == "epd_engine_environment":
                value = dict(value)
            out[key] = list(value) if isinstance(value, tuple) else value
        out["model_is_local"] = self.model_is_local
        out["vision_attention_block_size"] = self.vision_attention_block_size
        out["vision_tokens_bucket"] = self.vision_tokens_bucket
        out["executable"] = BACKEND_EXECUTABLES[self.engine_backend]
        return out


@dataclass(frozen=True)
class HostSpec:
    """One engine host: counts, core budget, exclusions, optional hand-pinned slices."""

    name: str
    num_ve: int = 0
    num_pd: int = 0
    core_count: int = 64
    excluded_cores: frozenset[int] = frozenset()
    faulted_cores: frozenset[int] = frozenset()
    # role -> hand-pinned slice starts, in engine order (None: the planner places that role)
    slices: Mapping[str, tuple[int, ...]] | None = None
    bind_address: str = "127.0.0.1"

    def count(self, role: str) -> int:
        return self.num_ve if role == "ve" else self.num_pd

    @property
    def blocked(self) -> frozenset[int]:
        """Cores no slice may touch: excluded by the inventory or faulted (within the budget)."""
        return frozenset(c for c in self.excluded_cores | self.faulted_cores if c < self.core_count)

    @property
    def usable_cores(self) -> int:
        return self.core_count - len(self.blocked)


# --------------------------------------------------------------------------- value checks


def _plain(value: Any) -> Any:
    """Strip Ansible wrapper types (tagged str/list/dict) down to plain Python values."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    return value


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def as_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (or a string of digits, as `-e key=value` passes it) within bounds."""
    if isinstance(value, bool):
        raise EpdPlanError(f"{name} must be an integer, got {_describe(value)}")
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        value = int(value)
    if not isinstance(value, int):
        raise EpdPlanError(f"{name} must be an integer, got {_describe(value)}")
    if minimum is not None and value < minimum:
        raise EpdPlanError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise EpdPlanError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def as_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise EpdPlanError(f"{name} must be a string, got {_describe(value)}")
    if CONTROL_CHARS.search(value):
        raise EpdPlanError(f"{name} must not contain control characters (newline, tab, ...): {value!r}")
    return str(value)


def as_str_list(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, Mapping)) or not isinstance(value, (list, tuple)):
        raise EpdPlanError(f"{name} must be a list of strings, got {_describe(value)}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise EpdPlanError(f"{name}[{i}] must be a string, got {_describe(item)}")
        out.append(as_str(f"{name}[{i}]", str(item)))
    return tuple(out)


def as_core_set(name: str, value: Any) -> frozenset[int]:
    """Core ids from a list of ints and "a-b" ranges (or one "a-b,c" string)."""
    if value is None:
        return frozenset()
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise EpdPlanError(f'{name} must be a list of core ids or "a-b" ranges, got {_describe(value)}')
    cores: set[int] = set()
    for item in value:
        match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", item) if isinstance(item, str) else None
        if match:
            low, high = int(match[1]), int(match[2])
            if low > high:
                raise EpdPlanError(f'{name}: range "{item}" runs backwards; write "{high}-{low}"')
            cores.update(range(low, high + 1))
        else:
            cores.add(as_int(f"{name} entry", item, minimum=0))
    return frozenset(cores)


def format_cores(cores: Iterable[int]) -> str:
    """[0,1,2,3,8] -> "0-3, 8"; empty -> "none"."""
    ordered = sorted(set(cores))
    if not ordered:
        return "none"
    parts, start, prev = [], ordered[0], ordered[0]
    for core in ordered[1:] + [None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(f"{start}-{prev}" if prev > start else f"{start}")
        if core is not None:
            start = prev = core
    return ", ".join(parts)


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


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
    if not HUB_ID.fullmatch(model):
        raise EpdPlanError(
            f"epd_model {model!r} is neither an absolute checkpoint directory nor a Hugging Face "
            "id like Qwen/Qwen3-VL-32B-Instruct"
        )
    return model


def check_extra_args(args: tuple[str, ...]) -> tuple[str, ...]:
    """Refuse extra argv that would break EPD or silently override a derived flag."""
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
    return args


def _port(name: str, value: Any) -> int:
    return as_int(name, value, minimum=MIN_PORT, maximum=MAX_PORT)


def read_settings(variables: Mapping[str, Any]) -> Settings:
    """Validate the fleet-wide settings; missing keys take GLOBAL_DEFAULTS."""

    def get(key: str) -> Any:
        return variables[key] if key in variables and variables[key] is not None else GLOBAL_DEFAULTS[key]

    quantization = as_str("epd_quantization", get("epd_quantization"))
    if quantization not in QUANTIZATIONS:
        raise EpdPlanError(f"epd_quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    backend = as_str("epd_engine_backend", get("epd_engine_backend"))
    if backend not in BACKEND_EXECUTABLES:
        raise EpdPlanError(f"epd_engine_backend must be vllm or sim, got {backend!r}")
    tps = {}
    for key in ("epd_ve_tp", "epd_pd_tp"):
        tps[key] = as_int(key, get(key), minimum=1, maximum=64)
        if not _is_power_of_two(tps[key]):
            raise EpdPlanError(
                f"{key} must be a power of two (1, 2, 4, 8, 16, 32, 64): trn2 tensor-parallel "
                f"groups map onto aligned core blocks, got {tps[key]}"
            )
    ve_dp = as_int("epd_ve_dp", get("epd_ve_dp"), minimum=1)
    if tps["epd_ve_tp"] % ve_dp:
        raise EpdPlanError(
            f"epd_ve_dp ({ve_dp}) must divide epd_ve_tp ({tps['epd_ve_tp']}): the vision encoder "
            "runs dp_size data-parallel replicas inside the VE's cores"
        )
    edge = as_int("epd_image_edge", get("epd_image_edge"), minimum=1)
    patch = as_int("epd_patch_size", get("epd_patch_size"), minimum=1)
    if edge % patch:
        raise EpdPlanError(
            f"epd_image_edge ({edge}) must be a multiple of epd_patch_size ({patch}), "
            f"e.g. {edge // patch * patch or patch}"
        )
    prefix = as_str("epd_engine_id_prefix", get("epd_engine_id_prefix"))
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", prefix):
        raise EpdPlanError(f"epd_engine_id_prefix must be letters, digits, '.', '_' or '-', got {prefix!r}")
    modules = as_str_list("epd_modules_to_not_convert", get("epd_modules_to_not_convert"))
    return Settings(
        model=check_model(variables.get("epd_model") if "epd_model" in variables else None),
        quantization=quantization,
        modules_to_not_convert=modules,
        engine_backend=backend,
        ve_tp=tps["epd_ve_tp"],
        ve_dp=ve_dp,
        pd_tp=tps["epd_pd_tp"],
        max_model_len=as_int("epd_max_model_len", get("epd_max_model_len"), minimum=1),
        max_num_seqs=as_int("epd_max_num_seqs", get("epd_max_num_seqs"), minimum=1),
        images_per_prompt=as_int("epd_images_per_prompt", get("epd_images_per_prompt"), minimum=1),
        image_edge=edge,
        patch_size=patch,
        encoder_cache_num_blocks=as_int("epd_encoder_cache_num_blocks", get("epd_encoder_cache_num_blocks"), minimum=2),
        ve_port_base=_port("epd_ve_port_base", get("epd_ve_port_base")),
        pd_port_base=_port("epd_pd_port_base", get("epd_pd_port_base")),
        side_channel_port_base=_port("epd_side_channel_port_base", get("epd_side_channel_port_base")),
        router_port=_port("epd_router_port", get("epd_router_port")),
        engine_id_prefix=prefix,
        start_stagger_s=as_int("epd_start_stagger_s", get("epd_start_stagger_s"), minimum=0),
        compilation_timeout_s=as_int("epd_compilation_timeout_s", get("epd_compilation_timeout_s"), minimum=1),
        extra_args=check_extra_args(as_str_list("epd_extra_args", get("epd_extra_args"))),
        engine_environment=check_engine_environment(get("epd_engine_environment")),
    )


# Environment the kit derives itself; an operator cannot override it per fleet.
MANAGED_ENV = ("NEURON_VISIBLE_DEVICES", "FI_EFA_ENABLE_SHM_TRANSFER", "FI_EFA_USE_DEVICE_RDMA")


def check_engine_environment(value: Any) -> tuple[tuple[str, str], ...]:
    """Extra engine environment (e.g. EPD_SIM_* latencies, NEURON_RT_* knobs): argv stays untouched."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise EpdPlanError(f"epd_engine_environment must be a mapping of NAME: value, got {_describe(value)}")
    out = []
    for name, item in sorted(value.items()):
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise EpdPlanError(f"epd_engine_environment: {name!r} is not a valid environment variable name")
        if name in MANAGED_ENV:
            raise EpdPlanError(
                f"epd_engine_environment sets {name}: the kit derives it (core slices, required EFA settings); "
                "remove it from the inventory"
            )
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise EpdPlanError(f"epd_engine_environment[{name}] must be a string or number, got {_describe(item)}")
        text = str(item)
        if "\n" in text:
            raise EpdPlanError(f"epd_engine_environment[{name}] must be a single line")
        out.append((name, text))
    return tuple(out)


def check_bind_address(host: str, value: Any) -> str:
    address = as_str(f"{host}: epd_bind_address", value).strip()
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", address):
            raise EpdPlanError(f"{host}: epd_bind_address {address!r} is neither an IP address nor a host name") from None
        return address
    if ip.is_unspecified:
        raise EpdPlanError(
            f"{host}: epd_bind_address {address} is a wildcard; engines advertise this address to "
            "the router and (VE side channel) to PD engines, so set the host's own address"
        )
    return address


def _slice_entry(host: str, role: str, index: int, entry: Any, tp: int) -> int:
    """A hand-pinned slice: a start core, an explicit core list, or an "a-b" range -> its start."""
    where = f"{host}: epd_slices.{role}[{index}]"
    if isinstance(entry, (list, tuple, str)):
        cores = sorted(as_core_set(where, entry))
        if len(cores) != tp:
            raise EpdPlanError(
                f"{where} has {len(cores)} cores ({format_cores(cores)}) but the {role.upper()} "
                f"tensor-parallel size is {tp}: TP must equal the number of cores in "
                "NEURON_VISIBLE_DEVICES (give a start core, or exactly tp contiguous cores)"
            )
        if cores != list(range(cores[0], cores[0] + tp)):
            raise EpdPlanError(f"{where} ({format_cores(cores)}) is not contiguous: a slice is {tp} consecutive cores")
        return cores[0]
    return as_int(where, entry, minimum=0)


def read_host(name: str, variables: Mapping[str, Any], settings: Settings, faulted: Iterable[int] = ()) -> HostSpec:
    """Validate one host's variables (missing keys take HOST_DEFAULTS)."""

    def get(key: str) -> Any:
        return variables[key] if key in variables and variables[key] is not None else HOST_DEFAULTS[key]

    core_count = as_int(f"{name}: epd_core_count", get("epd_core_count"), minimum=1, maximum=4096)
    excluded = as_core_set(f"{name}: epd_excluded_cores", get("epd_excluded_cores"))
    outside = sorted(c for c in excluded if c >= core_count)
    if outside:
        raise EpdPlanError(
            f"{name}: epd_excluded_cores lists {format_cores(outside)}, outside the host's "
            f"{core_count} cores (0-{core_count - 1}); fix the list or epd_core_count"
        )
    counts = {role: as_int(f"{name}: epd_num_{role}", get(f"epd_num_{role}"), minimum=0) for role in ROLES}
    raw_slices = get("epd_slices")
    slices: dict[str, tuple[int, ...]] | None = None
    if raw_slices not in (None, {}):
        if not isinstance(raw_slices, Mapping):
            raise EpdPlanError(f"{name}: epd_slices must be a mapping like {{ve: [0, 4], pd: [8, 16]}}, got {_describe(raw_slices)}")
        unknown = sorted(set(map(str, raw_slices)) - set(ROLES))
        if unknown:
            raise EpdPlanError(f"{name}: epd_slices has unknown key(s) {', '.join(unknown)}; use ve and pd")
        slices = {}
        for role in ROLES:
            if role not in raw_slices or raw_slices[role] is None:
                continue
            entries = raw_slices[role]
            if not isinstance(entries, (list, tuple)):
                raise EpdPlanError(f"{name}: epd_slices.{role} must be a list of slice starts, got {_describe(entries)}")
            starts = tuple(_slice_entry(name, role, i, e, settings.tp(role)) for i, e in enumerate(entries))
            explicit = f"epd_num_{role}" in variables and variables[f"epd_num_{role}"] is not None
            if explicit and counts[role] != len(starts):
                raise EpdPlanError(
                    f"{name}: epd_num_{role} is {counts[role]} but epd_slices.{role} pins "
                    f"{len(starts)} slices; make them agree (or drop epd_num_{role})"
                )
            counts[role] = len(starts)
            slices[role] = starts
    faulted_set = as_core_set(f"{name}: faulted cores", list(faulted))
    return HostSpec(
        name=name,
        num_ve=counts["ve"],
        num_pd=counts["pd"],
        core_count=core_count,
        excluded_cores=excluded,
        faulted_cores=faulted_set,
        slices=slices,
        bind_address=check_bind_address(name, get("epd_bind_address")),
    )


# --------------------------------------------------------------------------- placement


def placement_order(settings: Settings) -> tuple[str, ...]:
    """Widest TP first (PD before VE on a tie, as in the tutorial's table)."""
    return tuple(sorted(ROLES, key=lambda role: (-settings.tp(role), role != "pd")))


def check_pinned(host: HostSpec, settings: Settings) -> dict[str, list[int]]:
    """Hand-pinned slices obey the same rules as planned ones: aligned, in budget, disjoint, usable."""
    pinned: dict[str, list[int]] = {}
    owner: dict[int, str] = {}
    for role, starts in (host.slices or {}).items():
        tp = settings.tp(role)
        for index, start in enumerate(starts):
            label = f"{host.name}: epd_slices.{role}[{index}] = {start} (cores {format_cores(range(start, start + tp))})"
            if start % tp:
                raise EpdPlanError(
                    f"{label} is misaligned: a tp={tp} slice must start at a multiple of {tp} "
                    f"(e.g. {start // tp * tp} or {start // tp * tp + tp}); on trn2 a misaligned slice compiles, then "
                    "fails in prefill warmup (REDUCE_SCATTER not supported)"
                )
            if start + tp > host.core_count:
                raise EpdPlanError(f"{label} is over budget: the host has {host.core_count} cores (0-{host.core_count - 1})")
            bad = [c for c in range(start, start + tp) if c in host.blocked]
            if bad:
                reasons = []
                if set(bad) & host.excluded_cores:
                    reasons.append(f"excluded {format_cores(set(bad) & host.excluded_cores)}")
                if set(bad) & host.faulted_cores:
                    reasons.append(f"faulted {format_cores(set(bad) & host.faulted_cores)}")
                raise EpdPlanError(f"{label} uses unusable cores ({'; '.join(reasons)}); move it to a free aligned slice")
            for core in range(start, start + tp):
                if core in owner:
                    raise EpdPlanError(f"{label} overlaps {owner[core]} on core {core}; slices must be disjoint")
                owner[core] = f"epd_slices.{role}[{index}]"
            pinned.setdefault(role, []).append(start)
    return pinned


def place(host: HostSpec, settings: Settings, counts: Mapping[str, int] | None = None) -> dict[str, list[int]] | None:
    """Slice starts per role, or None when the counts do not fit.

    Pinned slices stay; the rest is placed widest TP first at the lowest aligned start whose
    cores are all free. With power-of-two TPs every aligned block of a narrow TP lies inside
    one aligned block of a wider TP, so this greedy order finds a layout whenever one exists
    (tests/unit/test_planner_properties.py checks it against brute force).
    """
    counts = counts or {role: host.count(role) for role in ROLES}
    pinned = check_pinned(host, settings)
    used = set(host.blocked)
    for role, starts in pinned.items():
        for start in starts:
            used.update(range(start, start + settings.tp(role)))
    result = {role: list(pinned.get(role, [])) for role in ROLES}
    for role in placement_order(settings):
        tp = settings.tp(role)
        missing = counts[role] - len(result[role])
        for start in range(0, host.core_count - tp + 1, tp):
            if missing <= 0:
                break
            block = range(start, start + tp)
            if used.isdisjoint(block):
                used.update(block)
                result[role].append(start)
                missing -= 1
        if missing > 0:
            return None
    return result


def largest_fits(host: HostSpec, settings: Settings) -> list[tuple[int, int]]:
    """The largest (VE, PD) counts that fit: keep one pool's request, shrink the other."""

    def fits(num_ve: int, num_pd: int) -> bool:
        pinned = {role: len((host.slices or {}).get(role, ())) for role in ROLES}
        if num_ve < pinned["ve"] or num_pd < pinned["pd"]:
            return False
        return place(host, settings, {"ve": num_ve, "pd": num_pd}) is not None

    def max_count(fixed_role: str, fixed: int) -> int | None:
        other = "pd" if fixed_role == "ve" else "ve"
        best = None
        # more engines than cores can never fit: bound the search for huge requests
        for n in range(min(host.count(other), host.core_count) + 1):
            counts = {fixed_role: fixed, other: n}
            if fits(counts["ve"], counts["pd"]):
                best = n
        return best

    options: list[tuple[int, int]] = []
    keep_ve = max_count("ve", host.num_ve)
    if keep_ve is not None:
        options.append((host.num_ve, keep_ve))
    keep_pd = max_count("pd", host.num_pd)
    if keep_pd is not None:
        options.append((keep_pd, host.num_pd))
    if not options:  # neither pool fits at its requested size: say what each fits alone
        for role in ROLES:
            alone = max_count("pd" if role == "ve" else "ve", 0)
            if alone:
                options.append((alone, 0) if role == "ve" else (0, alone))
    unique = []
    for option in options:
        if option != (0, 0) and option not in unique:
            unique.append(option)
    return unique


def _no_fit_message(host: HostSpec, settings: Settings) -> str:
    blocked = host.blocked
    where = f"{host.usable_cores} usable cores"
    if blocked:
        where += f" (of {host.core_count}; excluded/faulted: {format_cores(blocked)})"
    fits = largest_fits(host, settings)
    if fits:
        what = " or ".join(f"{ve} VE + {pd} PD" for ve, pd in fits) + " fit"
    else:
        what = "no engine fits"
    return (
        f"{host.name}: layout does not fit: {where}: {what}, you asked for {host.num_ve} VE "
        f"(tp {settings.ve_tp}) + {host.num_pd} PD (tp {settings.pd_tp}). Lower epd_num_ve/"
        "epd_num_pd on that host (keep the TP: changing it invalidates the compile cache), "
        "free cores, or move engines to another host. Each slice needs tp free cores starting "
        "at a multiple of tp."
    )


# --------------------------------------------------------------------------- argv and env


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


def serve_argv(settings: Settings, role: str, engine_id: str, bind_address: str, port: int, side_channel_port: int | None) -> list[str]:
    """The tutorial's `vllm serve` command, token by token (argv[0] names the backend)."""
    argv = [
        BACKEND_EXECUTABLES[settings.engine_backend], "serve", settings.model,
        "--tensor-parallel-size", str(settings.tp(role)),
        "--host", bind_address,
        "--port", str(port),
        "--max-model-len", str(settings.max_model_len),
        "--max-num-batched-tokens", str(settings.max_model_len),
        "--max-num-seqs", str(1 if role == "ve" else settings.max_num_seqs),
        "--dtype", "bfloat16",
        "--limit-mm-per-prompt", json.dumps({"image": settings.images_per_prompt}),
        "--no-enable-prefix-caching",
    ]
    argv += ["--mm-encoder-only", "--no-async-scheduling"] if role == "ve" else ["--mm-processor-cache-gb", "0"]
    argv += ["--additional-config", json.dumps(additional_config(settings, role))]
    argv += ["--ec-transfer-config", json.dumps(ec_transfer_config(role, engine_id, bind_address, side_channel_port))]
    return argv + list(settings.extra_args)


def engine_env(settings: Settings, cores: Sequence[int]) -> dict[str, str]:
    env = {
        "NEURON_VISIBLE_DEVICES": ",".join(str(c) for c in cores),
        # required, not tuning: without them LIBFABRIC may pick SHM and PD dies with ECLoadFailure
        "FI_EFA_ENABLE_SHM_TRANSFER": "0",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "VLLM_NEURON_COMPILATION_TIMEOUT": str(settings.compilation_timeout_s),
    }
    if settings.model_is_local:
        env["HF_HUB_OFFLINE"] = "1"
    env.update(settings.engine_environment)
    return env


# --------------------------------------------------------------------------- fleet plan


def _url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def plan_fleet(settings: Settings, hosts: Sequence[HostSpec]) -> dict[str, dict[str, Any]]:
    """Plan every host in inventory order; engine ids are numbered fleet-wide."""
    names = [h.name for h in hosts]
    if not hosts:
        raise EpdPlanError("no engine hosts: add hosts to the epd_engines group")
    if len(set(names)) != len(names):
        raise EpdPlanError(f"host listed twice in the engine hosts: {sorted(n for n in names if names.count(n) > 1)[0]}")
    next_index = {role: 0 for role in ROLES}
    plan: dict[str, dict[str, Any]] = {}
    for host in hosts:
        starts = place(host, settings)
        if starts is None:
            raise EpdPlanError(_no_fit_message(host, settings))
        engines = []
        for role in ROLES:
            tp = settings.tp(role)
            for local, start in enumerate(starts[role]):
                number = next_index[role] + local
                engine_id = f"{settings.engine_id_prefix}-{role}-{number}"
                port = (settings.ve_port_base if role == "ve" else settings.pd_port_base) + local
                side = settings.side_channel_port_base + local * tp if role == "ve" else None
                cores = list(range(start, start + tp))
                engines.append({
                    "instance": f"{role}-{number}",
                    "role": role,
                    "engine_id": engine_id,
                    "tp": tp,
                    "dp": settings.ve_dp if role == "ve" else 1,
                    "cores": cores,
                    "host": host.bind_address,
                    "port": port,
                    "url": _url(host.bind_address, port),
                    "side_channel_port": side,
                    "side_channel_ports": list(range(side, side + tp)) if side is not None else [],
                    "start_delay_s": 0,
                    "argv": serve_argv(settings, role, engine_id, host.bind_address, port, side),
                    "env": engine_env(settings, cores),
                })
            next_index[role] += len(starts[role])
        engines.sort(key=lambda e: e["cores"][0])
        for position, engine in enumerate(engines):
            engine["start_delay_s"] = position * settings.start_stagger_s
        plan[host.name] = {
            "host": host.name,
            "bind_address": host.bind_address,
            "core_count": host.core_count,
            "usable_cores": host.usable_cores,
            "excluded_cores": sorted(host.excluded_cores),
            "faulted_cores": sorted(c for c in host.faulted_cores if c < host.core_count),
            "engines": engines,
        }
    validate_plan(plan, settings)
    return plan


def validate_plan(plan: Mapping[str, Mapping[str, Any]], settings: Settings) -> None:
    """Fleet-wide invariants: unique engine ids and endpoints, per-host ports and cores."""
    ids: dict[str, str] = {}
    urls: dict[str, str] = {}
    hosts_with_engines = [h for h, p in plan.items() if p["engines"]]
    for host, host_plan in plan.items():
        ports: dict[int, str] = {settings.router_port: "the router (epd_router_port)"}
        cores: dict[int, str] = {}
        for engine in host_plan["engines"]:
            eid = engine["engine_id"]
            if eid in ids:
                raise EpdPlanError(f"duplicate engine id {eid} on {ids[eid]} and {host}: engine ids key NIXL handshakes and must be unique fleet-wide")
            ids[eid] = host
            if len(engine["cores"]) != engine["tp"] or engine["cores"][0] % engine["tp"]:
                raise EpdPlanError(f"{host}: {eid} cores {format_cores(engine['cores'])} do not form an aligned tp={engine['tp']} slice")
            for core in engine["cores"]:
                if core in cores:
                    raise EpdPlanError(f"{host}: core {core} assigned to both {cores[core]} and {eid}")
                cores[core] = eid
            uses = [(engine["port"], f"{eid} (HTTP)")]
            uses += [(p, f"{eid} (side channel rank {r})") for r, p in enumerate(engine["side_channel_ports"])]
            for port, what in uses:
                if not MIN_PORT <= port <= MAX_PORT:
                    raise EpdPlanError(f"{host}: port {port} of {what} is outside {MIN_PORT}-{MAX_PORT}; lower the port bases")
                if port in ports:
                    raise EpdPlanError(
                        f"{host}: port {port} is used by both {ports[port]} and {what}; move "
                        "epd_ve_port_base, epd_pd_port_base, epd_side_channel_port_base or "
                        "epd_router_port so the ranges do not overlap"
                    )
                ports[port] = what
    for host, host_plan in plan.items():
        for engine in host_plan["engines"]:
            if engine["url"] in urls:
                raise EpdPlanError(
                    f"{host} and {urls[engine['url']]} both serve {engine['url']}: give each host its "
                    "own epd_bind_address (its private address)"
                )
            urls[engine["url"]] = host
    if len(hosts_with_engines) > 1:
        for host in hosts_with_engines:
            if _is_loopback(plan[host]["bind_address"]):
                raise EpdPlanError(
                    f"{host} binds its engines to {plan[host]['bind_address']} in a multi-host fleet: "
                    "the router and PD engines on other hosts cannot reach it; set epd_bind_address "
                    "to the host's private address"
                )


def router_endpoints(plan: Mapping[str, Mapping[str, Any]]) -> dict[str, list[dict[str, str]]]:
    """The router's endpoint lists (ids, URLs, state active), in fleet-wide engine order."""
    out: dict[str, list[dict[str, Any]]] = {role: [] for role in ROLES}
    for host_plan in plan.values():
        for engine in host_plan["engines"]:
            out[engine["role"]].append({"id": engine["engine_id"], "url": engine["url"], "state": "active"})
    for role in ROLES:
        out[role].sort(key=lambda e: int(e["id"].rsplit("-", 1)[1]))
    return out


def plan_table(plan: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per engine: host, instance, role, cores, ports, engine id (for plan.yml)."""
    header = ("host", "engine", "role", "cores", "port", "side channel", "engine id", "start +s")
    rows = [header]
    for host, host_plan in plan.items():
        if not host_plan["engines"]:
            rows.append((host, "-", "-", "-", "-", "-", "-", "-"))
        for e in host_plan["engines"]:
            side = e["side_channel_ports"]
            rows.append((
                host, e["instance"], f"{e['role']} tp{e['tp']}", format_cores(e["cores"]), str(e["port"]),
                f"{side[0]}-{side[-1]}" if side else "-", e["engine_id"], str(e["start_delay_s"]),
            ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for host, host_plan in plan.items():
        lines.append(
            f"{host}: {host_plan['usable_cores']}/{host_plan['core_count']} usable cores, excluded "
            f"{format_cores(host_plan['excluded_cores'])}, faulted {format_cores(host_plan['faulted_cores'])}"
        )
    return lines


# --------------------------------------------------------------------------- Ansible glue


def _host_vars(hostvars: Mapping[str, Any], host: str) -> Mapping[str, Any]:
    if host not in hostvars:
        raise EpdPlanError(f"host {host!r} is not in the inventory")
    return hostvars[host]


def _lookup(variables: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """Only the keys we need: touching other hostvars would template unrelated variables."""
    return {key: _plain(variables[key]) for key in keys if key in variables}


def _faulted_from_facts(variables: Mapping[str, Any]) -> list[int]:
    facts = variables["ansible_facts"] if "ansible_facts" in variables else {}
    neuron = facts.get("epd_neuron") if isinstance(facts, Mapping) else None
    return list(_plain(neuron.get("faulted_cores", []))) if isinstance(neuron, Mapping) else []


def _faulted_for(faulted: Any, host: str, variables: Mapping[str, Any]) -> list[int]:
    """faulted: {host: [cores]} or {host: <epd_neuron_facts result>}; else the host's facts."""
    if faulted is not None and not isinstance(faulted, Mapping):
        raise EpdPlanError(f"faulted must map host -> faulted cores, got {_describe(faulted)}")
    if faulted and host in faulted:
        entry = _plain(faulted[host])
        if isinstance(entry, Mapping):
            entry = entry.get("faulted_cores", [])
        return list(entry or [])
    return _faulted_from_facts(variables)


def fleet_settings(hostvars: Mapping[str, Any], hosts: Sequence[str]) -> Settings:
    """Settings from the engine hosts' variables; each must agree across hosts."""
    if isinstance(hosts, str) or not isinstance(hosts, (list, tuple)):
        raise EpdPlanError(f"epd_plan expects the list of engine hosts (groups['epd_engines']), got {_describe(hosts)}")
    if not hosts:
        raise EpdPlanError("no engine hosts: add hosts to the epd_engines group")
    per_host = {str(h): _lookup(_host_vars(hostvars, str(h)), GLOBAL_DEFAULTS) for h in hosts}
    first = str(hosts[0])
    for key in GLOBAL_DEFAULTS:
        values = {h: v.get(key, GLOBAL_DEFAULTS[key]) for h, v in per_host.items()}
        if any(v != values[first] for v in values.values()):
            shown = ", ".join(f"{h}: {v!r}" for h, v in values.items())
            raise EpdPlanError(f"{key} differs between engine hosts ({shown}); pool settings are fleet-wide: set it once in group_vars/all")
    return read_settings(per_host[first])


def plan_from_hostvars(hostvars: Mapping[str, Any], hosts: Sequence[str], faulted: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    settings = fleet_settings(hostvars, hosts)
    specs = []
    for name in map(str, hosts):
        variables = _host_vars(hostvars, name)
        specs.append(read_host(name, _lookup(variables, HOST_DEFAULTS), settings, _faulted_for(faulted, name, variables)))
    return plan_fleet(settings, specs)


def _ansible(function):
    """Convert planner errors into AnsibleFilterError so the task fails with our message."""

    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except EpdPlanError as error:
            from ansible.errors import AnsibleFilterError

            raise AnsibleFilterError(f"epd planner: {error}") from None

    wrapper.__name__ = function.__name__
    wrapper.__doc__ = function.__doc__
    return wrapper


class FilterModule:
    """epd_plan, epd_settings, epd_router_endpoints, epd_plan_table."""

    def filters(self):
        return {
            "epd_plan": _ansible(plan_from_hostvars),
            "epd_settings": _ansible(lambda hostvars, hosts: fleet_settings(hostvars, hosts).as_dict()),
            "epd_router_endpoints": _ansible(router_endpoints),
            "epd_plan_table": _ansible(plan_table),
        }
