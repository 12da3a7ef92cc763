"""The fleet's models as one list (fleet_models): epd_model with each host's epd_num_ve / epd_num_pd
and the fleet-wide settings is models[0]; the entries of `epd_models` follow, each its own
checkpoint, pools and settings. Naming rule: models[0]'s engines keep ids and units without a
model prefix (pd-0, epd-pd-0, rollout key `pd`), so a fleet deployed before epd_models existed
re-deploys without a restart; an epd_models entry's carry its name (text-pd-0, `pd:text`).
`epd_models` lists the models served beside epd_model, one mapping each:

    name            the served name (the request's `model`), and part of its engines' ids and
                    unit names (epd-engine@<name>-pd-0): letters, digits, '.', '_', '-', not
                    starting with '_' (RESERVED_PREFIX)
    model           its checkpoint (as epd_model)
    text_only       true: PD alone, no VE (images refused with the router's 400)
    num_ve, num_pd  engines per engine host it runs on
    hosts           the engine hosts it runs on (default: every engine host)
    ve_tp, ve_dp, pd_tp, max_model_len, max_num_seqs, images_per_prompt, image_edge,
    patch_size, encoder_cache_num_blocks, quantization, modules_to_not_convert, extra_args
                    its own values of those fleet settings (default: the fleet's)
    ve_port_base, pd_port_base, side_channel_port_base
                    its own port bases (default: the fleet's + 64 x its position, 1-based, so
                    no two models' engines share a port on a host)
    rollout_batch_ve, rollout_batch_pd, rollout_min_available_ve, rollout_min_available_pd
                    its pools' own rollout batch and floor (default: the fleet's; rollout.py)

Every value is checked by the fleet settings' own rules (settings.read_settings), each problem
naming the model. docs/planner.md "Several models".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import EpdPlanError
from .hints import did_you_mean
from .values import ID_PART, as_int, as_str, describe, plain

# an epd_models entry's default port bases: the fleet's + this per position (a host's 64 cores
# hold at most 64 engines of one role, and a VE's side-channel ports stride by its TP)
PORT_STRIDE = 64
# The router metrics' own values of their `model` label start with RESERVED_PREFIX, so no served
# name may (epd_router_served_model_name included): NO_MODEL is the label of a
# request refused before its model was known (epd_kit/router/metrics.py, docs/observability.md
# "The model label"); the prefix keeps room for more such values without another rule.
RESERVED_PREFIX = "_"
NO_MODEL = f"{RESERVED_PREFIX}none"
SETTING_KEYS = (
    "ve_tp",
    "ve_dp",
    "pd_tp",
    "max_model_len",
    "max_num_seqs",
    "images_per_prompt",
    "image_edge",
    "patch_size",
    "encoder_cache_num_blocks",
    "quantization",
    "modules_to_not_convert",
    "extra_args",
)
PORT_KEYS = ("ve_port_base", "pd_port_base", "side_channel_port_base")
# the model's own rollout batch and floor per pool (rollout.py _pool_settings; default: the fleet's
# epd_rollout_batch_<pool> / epd_rollout_min_available_<pool>): each model's pools roll on their own
ROLLOUT_KEYS = ("rollout_batch_ve", "rollout_batch_pd", "rollout_min_available_ve", "rollout_min_available_pd")
ENTRY_KEYS = ("name", "model", "text_only", "num_ve", "num_pd", "hosts", *SETTING_KEYS, *PORT_KEYS, *ROLLOUT_KEYS)


@dataclass(frozen=True)
class ModelSpec:
    """One model of the fleet: its name, its own settings (its checkpoint, TPs, ports), its pools."""

    name: str
    settings: Any  # its settings.Settings (settings.py imports this module, not the other way)
    text_only: bool = False
    num_ve: int = 0
    num_pd: int = 1
    hosts: tuple[str, ...] | None = None  # None: every engine host
    rollout: tuple[tuple[str, Any], ...] = ()  # (ROLLOUT_KEYS key, value) the entry sets
    # False for models[0] (epd_model): its engines carry no `model` key and no name prefix
    prefixed: bool = True

    @property
    def key(self) -> str | None:
        """Its engines' `model` key in the plan and the prefix of their ids, units and rollout
        keys; None for models[0] (the naming rule above)."""
        return self.name if self.prefixed else None

    def runs_on(self, host: str) -> bool:
        return self.hosts is None or host in self.hosts

    def count(self, role: str) -> int:
        return self.num_ve if role == "ve" else self.num_pd

    def as_dict(self) -> dict[str, Any]:
        """The entry as read_models reads it back, every setting resolved (epd_fleet_settings)."""
        s = self.settings
        out: dict[str, Any] = {
            "name": self.name,
            "model": s.model,
            "text_only": self.text_only,
            "num_ve": self.num_ve,
            "num_pd": self.num_pd,
            "hosts": None if self.hosts is None else list(self.hosts),
        }
        for key in (*SETTING_KEYS, *PORT_KEYS):
            value = getattr(s, key)
            out[key] = list(value) if isinstance(value, tuple) else value
        out.update(self.rollout)
        return out


def reserved_name(name: str) -> str | None:
    """Why `name` cannot be a served name, or None when it can."""
    if not name.startswith(RESERVED_PREFIX):
        return None
    return (
        f"{name!r} starts with {RESERVED_PREFIX!r}: the router's metrics keep such names for their own "
        f"values of the model label ({NO_MODEL}: a request refused before its model was known)"
    )


def fleet_models(settings: Any, text_only: bool = False) -> tuple[ModelSpec, ...]:
    """Every model of the fleet: epd_model (`text_only`: the fleet's epd_text_only; its counts are
    each host's epd_num_ve / epd_num_pd, placement.py) first, then settings.models (epd_models)."""
    return (ModelSpec(settings.model, settings, text_only, prefixed=False), *settings.models)


def first_name_problems(served: Mapping[str, Any], models: Sequence[ModelSpec]) -> list[str]:
    """models[0]'s served name on each router host (`served`: host -> its
    epd_router_served_model_name, None when unset: epd_model, which cannot start with '_' and
    read_models holds against the epd_models names) against the reserved names and `models`' names."""
    problems = []
    for host, name in served.items():
        if name is None:
            continue
        why = reserved_name(str(name))
        if why:
            problems.append(f"{host}: epd_router_served_model_name {why}; choose another name")
        for index, spec in enumerate(models):
            if spec.name == str(name):
                problems.append(
                    f"{host}: epd_router_served_model_name {spec.name!r} is also epd_models[{index}]'s name; names "
                    "must differ (a request's model picks the model by it)"
                )
    return problems


def read_models(variables: Mapping[str, Any], fleet: Any, read_settings: Any) -> tuple[ModelSpec, ...]:
    """epd_models, validated; `read_settings` reads each model's settings from the fleet's
    variables with the entry's own values put over them (passed in: settings.py calls this)."""
    raw = plain(variables.get("epd_models")) if "epd_models" in variables else None
    if raw in (None, [], ()):
        return ()
    if not isinstance(raw, (list, tuple)):
        raise EpdPlanError(f"epd_models must be a list of models (name, model, num_pd, ...), got {describe(raw)}")
    names: dict[str, int] = {}
    models = []
    for index, entry in enumerate(raw):
        where = f"epd_models[{index}]"
        if not isinstance(entry, Mapping):
            raise EpdPlanError(f"{where} must be a mapping with name, model, num_ve/num_pd, got {describe(entry)}")
        # the keys first: a misspelt `name` is that, not an empty name
        unknown = sorted(set(map(str, entry)) - set(ENTRY_KEYS))
        if unknown:
            hints = "; ".join(did_you_mean(key, ENTRY_KEYS, "remove it") for key in unknown)
            known = ", ".join(ENTRY_KEYS)
            raise EpdPlanError(f"{where}: unknown key(s) {', '.join(unknown)}: {hints} (known: {known})")
        if "name" not in entry:
            raise EpdPlanError(f"{where} has no name: give each model its served name (name: text)")
        name = as_str(f"{where}.name", entry.get("name", "")).strip()
        why = reserved_name(name)
        if why:
            raise EpdPlanError(f"{where}.name {why}; choose another name")
        if not ID_PART.fullmatch(name):
            raise EpdPlanError(
                f"{where}.name {name!r} must be letters, digits, '.', '_' or '-' (it is the served model name "
                "and part of its engines' ids and unit names)"
            )
        where = f"epd_models[{index}] ({name})"
        if name in names:
            raise EpdPlanError(f"{where}: the name {name!r} is also epd_models[{names[name]}]'s; names must differ")
        if name == fleet.model:
            raise EpdPlanError(f"{where}: the name {name!r} is epd_model's; names must differ")
        names[name] = index
        overrides: dict[str, Any] = {"epd_models": [], "epd_model": entry.get("model")}
        for key in SETTING_KEYS:
            if key in entry and entry[key] is not None:
                overrides[f"epd_{key}"] = entry[key]
        for key in PORT_KEYS:
            base = getattr(fleet, key) + PORT_STRIDE * (index + 1)
            overrides[f"epd_{key}"] = entry[key] if entry.get(key) is not None else base
        try:
            settings = read_settings({**variables, **overrides})
        except EpdPlanError as error:
            raise EpdPlanError(f"{where}: {error}") from None
        text_only = entry.get("text_only", False)
        if not isinstance(text_only, bool):
            raise EpdPlanError(f"{where}.text_only must be true or false, got {describe(text_only)}")
        num_ve = as_int(f"{where}.num_ve", entry.get("num_ve", 0), minimum=0)
        num_pd = as_int(f"{where}.num_pd", entry.get("num_pd", 1), minimum=1)
        if text_only and num_ve:
            raise EpdPlanError(f"{where}: text_only is true but num_ve is {num_ve}: set num_ve to 0 or drop text_only")
        if not text_only and not num_ve:
            raise EpdPlanError(
                f"{where}: no VE engine (num_ve 0): set num_ve, or text_only: true for a model that serves text only"
            )
        hosts = entry.get("hosts")
        if hosts is not None:
            if not isinstance(hosts, (list, tuple)) or not hosts or not all(isinstance(h, str) for h in hosts):
                raise EpdPlanError(f"{where}.hosts must be a list of engine host names, got {describe(hosts)}")
            hosts = tuple(hosts)
        rollout = tuple((key, plain(entry[key])) for key in ROLLOUT_KEYS if entry.get(key) not in (None, ""))
        models.append(ModelSpec(name, settings, text_only, num_ve, num_pd, hosts, rollout))
    return tuple(models)


def check_model_hosts(models: Sequence[ModelSpec], engine_hosts: Sequence[str]) -> None:
    for index, spec in enumerate(models):
        for host in spec.hosts or ():
            if host not in engine_hosts:
                raise EpdPlanError(
                    f"epd_models[{index}] ({spec.name}).hosts names {host}, which is not an engine host "
                    f"(epd_engines: {', '.join(engine_hosts)})"
                )
