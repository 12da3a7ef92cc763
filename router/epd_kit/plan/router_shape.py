"""router.yaml's shapes, as plain data (no pydantic: the planner reads them on a controller without
the router's packages). Every model is one entry of `models` (its name, checkpoint, quantization,
limits and endpoints); the release before issue 57 wrote one model at the top level (`model`,
`served_model_name`, `quantization`, `endpoints`) and the pools of the others under
`endpoints.models.<name>`. models_as_list reads either as the one list: the router's schema
(epd_kit/router_yaml.py), a rollout's endpoints-only write of the file a host has
(router_config.endpoints_only) and the router play's roll decision (restart_view) all go through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# the keys of router.yaml's shape before `models` held every model (the release before issue 57):
# the served name, checkpoint and quantization of the model a request without `model` gets and,
# in `endpoints`, its pools, with the pools of each model of `models` under `endpoints.models.<name>`
OLD_SHAPE_KEYS = ("model", "served_model_name", "quantization", "endpoints")
# where an old-shape file has what the one list holds: a problem is named by the file's own key
Loc = tuple[str | int, ...]


def models_as_list(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[Loc, Loc]]]:
    """router.yaml with every model in `models` (each its name, checkpoint, limits, endpoints).
    A file in the old shape (OLD_SHAPE_KEYS at the top) loads as the model those keys describe,
    then the entries of its `models`; the file in the new shape is returned as it is. Also
    returns (location in the list, location in the file) pairs, most specific first, so a
    problem names the key the file has. Raises ValueError for an old-shape file whose models and
    pools do not pair up (the plan, rollout.py, and the router read it through here alike)."""
    if not any(key in data for key in OLD_SHAPE_KEYS):
        return dict(data), []
    rest = {k: v for k, v in data.items() if k not in OLD_SHAPE_KEYS}
    endpoints = data.get("endpoints")
    pools = dict(endpoints) if isinstance(endpoints, Mapping) else endpoints
    lanes = (pools.pop("models", None) or {}) if isinstance(pools, dict) else {}
    first: dict[str, Any] = {"endpoints": pools} if pools is not None else {}
    served = data.get("served_model_name")
    # the served name is served_model_name, else the checkpoint; with neither, `model` is missing
    name_key = "served_model_name" if served is not None else "model (the served name without served_model_name)"
    if served is None and data.get("model") is None:
        name_key = "model"
    if served is not None or data.get("model") is not None:
        first["name"] = served if served is not None else data["model"]
    for key in ("model", "quantization"):
        if key in data:
            first[key] = data[key]
    renames: list[tuple[Loc, Loc]] = [
        (("models", 0, "endpoints"), ("endpoints",)),
        (("models", 0, "name"), (name_key,)),
    ]
    renames += [(("models", 0, key), (key,)) for key in ("model", "quantization")]
    models = [first]
    names = []
    for index, entry in enumerate(data.get("models") or []):
        if isinstance(entry, Mapping) and "endpoints" in entry:
            raise ValueError(
                f"models[{index}].endpoints beside the top-level `model`/`endpoints`: write every model in "
                "`models` with its own endpoints (docs/router.md 'Router config file'), or the old shape whole"
            )
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if name is not None and name in (first.get("name"), *names):
            raise ValueError(served_twice(index, name))
        names.append(name)
        if isinstance(entry, Mapping) and name not in lanes:
            raise ValueError(f"models[{index}] ({name}) has no pools: add endpoints.models.{name}")
        models.append({**entry, "endpoints": lanes[name]} if isinstance(entry, Mapping) else entry)
        renames.append((("models", index + 1, "endpoints"), ("endpoints", "models", str(name))))
        renames.append((("models", index + 1), ("models", index)))
    extra = sorted(set(lanes) - set(names))
    if extra:
        raise ValueError(f"endpoints.models.{extra[0]}: no such model in `models` (its name, checkpoint)")
    return {**rest, "models": models}, renames


def served_twice(index: int, name: str) -> str:
    return f"models[{index}].name {name!r} is served twice: each model needs its own name"


def restart_view(config: Mapping[str, Any]) -> dict[str, Any]:
    """What of router.yaml its processes read only at start: everything but each model's
    `endpoints` (a reload applies those), each model's limits over the top-level section's as its
    lane reads them, unset keys left out. Two files with the same view run the same processes,
    whatever their shape: the router play rolls the processes only when the views differ
    (roles/epd_router/tasks/configure.yml), so the first write of the one-list shape over a file
    of the release before is a reload, not a restart."""
    if not config:
        return {}
    try:
        data, _ = models_as_list(config)
    except ValueError as error:  # not the router's either: whatever replaces it rolls the processes
        return {"unreadable": str(error)}
    top = data.get("limits") if isinstance(data.get("limits"), Mapping) else {}
    models = []
    for entry in data.get("models") or []:
        if not isinstance(entry, Mapping):
            models.append(entry)
            continue
        view = {k: v for k, v in entry.items() if k not in ("endpoints", "limits") and v is not None}
        models.append({**view, "limits": {**top, **(entry.get("limits") or {})}})
    return {**{k: v for k, v in data.items() if k not in ("models", "limits")}, "models": models}
