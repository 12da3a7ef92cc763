"""The router's configuration file (/etc/epd/router.yaml) from the fleet plan and the router role's overrides.

The models (each its name, checkpoint, quantization, image limits and endpoints: one list,
router_shape.py), engine dtype, listen port, auth come from the plan; every other section is the
role's overrides of the router's own defaults (the router is the one place they live, docs/router.md).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .backends import EC_READ_ENGINE_DIES
from .command import ENGINE_DTYPE, ROLES, merge
from .fleet import router_endpoints
from .models import fleet_models
from .router_shape import models_as_list
from .settings import Settings

OVERRIDABLE_SECTIONS = ("timeouts", "limits", "media", "health", "placement", "retries")


def router_config(
    plan: Mapping[str, Mapping[str, Any]],
    settings: Settings,
    *,
    listen_host: str,
    served_model_name: str | None = None,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
    api_keys_file: str | None = None,
    tenants_file: str | None = None,
    draining: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
    engine_key_file: str | None = None,
    admin_token_file: str | None = None,
    admin_networks: Sequence[str] | None = None,
    monitoring_addresses: Sequence[str] = (),
    loadbalancer_addresses: Sequence[str] = (),
    text_only: bool = False,
    running: Mapping[str, Any] | None = None,
    trust_parent_sampled: bool = False,
    retiring: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """router.yaml as a mapping; `extra` is merged last, recursively. `text_only`: the fleet's
    epd_text_only as the inventory check read it (its settings' epd_text_only), written into
    epd_model's `endpoints` so the router accepts the empty VE list of the plan and refuses images.
    `served_model_name`: epd_model's served name (None: its checkpoint).

    `retiring`: engines the router serves that the plan no longer has (rollout.retiring_endpoints'
    `engines`, from its GET /pools), each added draining to its model's pools.

    `running`: the router.yaml the host has (parsed, either shape; empty or None: none yet).
    Given, only its models' `endpoints` change (`endpoints_only`): the draining writes of a rollout
    (rolling_batch.yml, drain_retiring.yml) leave every other section, the models' names and
    checkpoints included, to the router play, which rolls the processes for what a reload does not
    apply (docs/operations.md "Several models")."""
    sections = sections or {}
    config: dict[str, Any] = {
        "listen": {"host": listen_host, "port": settings.router_port},
        # the engines' --dtype: the router sends VE pixel values in it
        "dtype": ENGINE_DTYPE,
        # how the VEs hand encoder outputs to the PDs: follows the engines' vLLM (Settings.handoff)
        "handoff": settings.handoff,
        # the context checks of the engines' vLLM front (Settings.front_checks)
        "front_checks": settings.front_checks,
    }
    # how a PD's failed read of an item reaches the router (Settings.ec_read_failure): written only
    # where it is not the router's default (engine_dies), so a file of a release that did not know
    # the key reads the same to the processes (router_shape.restart_view) and rolls none of them
    if settings.ec_read_failure != EC_READ_ENGINE_DIES:
        config["ec_read_failure"] = settings.ec_read_failure
    # `limits`: the fleet's; each model's image limits are its entry's (model_entry)
    for name in OVERRIDABLE_SECTIONS:
        config[name] = dict(sections.get(name) or {})
    # without keys, say "off" outright: a reload only drops the keys of a running router when told so
    auth = {"api_keys_file": api_keys_file, "tenants_file": tenants_file}
    config["auth"] = {k: v for k, v in auth.items() if v} or {"enabled": False}
    config["engine_auth"] = {"key_file": engine_key_file}
    config["admin"] = {
        "networks": admin_networks_of(admin_networks, listen_host, monitoring_addresses, loadbalancer_addresses),
        "token_file": admin_token_file,
    }
    if settings.otlp_traces_endpoint:  # the router's spans go where the engines' go
        config["tracing"] = {"otlp_traces_endpoint": settings.otlp_traces_endpoint}
        if trust_parent_sampled:  # epd_router_trust_parent_sampled: a gateway in front samples
            config["tracing"]["trust_parent_sampled"] = True
    config["models"] = []
    for spec in fleet_models(settings, text_only):
        lists = router_endpoints(plan, draining, spec.key)
        name = served_model_name if served_model_name and not spec.prefixed else spec.name
        endpoints = {"text_only": True, **lists} if spec.text_only else lists
        config["models"].append(model_entry(name, spec.settings, endpoints))
    for engine in retiring:
        entry = _entry_of(config["models"], engine)
        if entry is not None:
            endpoint = {"id": engine["id"], "url": engine["url"], "state": "draining"}
            entry["endpoints"].setdefault(engine["role"], []).append(endpoint)
    config = merge(config, extra or {})
    return endpoints_only(config, running) if running else config


def _entry_of(models: Sequence[dict[str, Any]], engine: Mapping[str, Any]) -> dict[str, Any] | None:
    """The entry of the model whose pools an engine of GET /pools is in: by its `model` (the
    served name, given when the router serves several), else the one listed first."""
    if not engine.get("model_index"):
        return models[0]
    return next((m for m in models if m["name"] == engine.get("model")), None)


def endpoints_only(config: Mapping[str, Any], running: Mapping[str, Any]) -> dict[str, Any]:
    """`running` (in the one-list shape) with the endpoints of `config`, for the models `running`
    serves (its `models`, read at start; the one listed first also when its name changed): a
    model `config` adds gets its pools when the router play rolls the processes; one `config` no
    longer has keeps its running pools, every engine draining, so its requests finish in its own
    pools before its engines stop."""
    running, _ = models_as_list(running)
    planned = {entry["name"]: entry for entry in config["models"]}
    models = []
    for position, entry in enumerate(running.get("models") or []):
        new = planned.get(entry["name"]) or (config["models"][0] if position == 0 else None)
        if new is not None:
            endpoints = new["endpoints"]
        else:
            lane = entry.get("endpoints") or {}
            endpoints = {**lane, **{r: [{**e, "state": "draining"} for e in lane.get(r) or []] for r in ROLES}}
        models.append({**entry, "endpoints": endpoints})
    return {**running, "models": models}


def model_entry(name: str, settings: Settings, endpoints: Mapping[str, Any]) -> dict[str, Any]:
    """One model in router.yaml's `models`: its served name, checkpoint, the limits its settings
    fix (the other limits are the top-level section's) and its pools."""
    return {
        "name": name,
        "model": settings.model,
        "quantization": None if settings.quantization == "bf16" else settings.quantization,
        "limits": {
            "images_per_prompt": settings.images_per_prompt,
            "max_image_patches": settings.vision_attention_block_size,
        },
        "endpoints": dict(endpoints),
    }


LOOPBACK = ["127.0.0.0/8", "::1/128"]


def admin_networks_of(
    explicit: Sequence[str] | None,
    listen_host: str,
    monitoring: Iterable[str],
    loadbalancers: Iterable[str],
) -> list[str]:
    """admin.networks: loopback and the router host's own address always (the kit's own calls
    to /pools come from the host itself, to its listen address), then `explicit`
    (epd_admin_networks) or, without it, the monitoring hosts' addresses. A load balancer's
    address is never taken by default: behind HAProxy every client's requests come from it."""
    own = _host_networks([listen_host])
    chosen = list(explicit) if explicit is not None else _host_networks(monitoring, skip=set(loadbalancers))
    networks: list[str] = []
    for network in [*LOOPBACK, *own, *chosen]:
        if network not in networks:
            networks.append(network)
    return networks


def _host_networks(addresses: Iterable[str], skip: Iterable[str] = ()) -> list[str]:
    """Each address that is an IP literal, as a one-address network (a name is skipped: the
    router compares the peer's address; list such hosts in epd_admin_networks)."""
    networks, skipped = [], set(skip)
    for address in addresses:
        try:
            ip = ipaddress.ip_address(str(address))
        except ValueError:
            continue
        if ip.is_unspecified or str(ip) in skipped:
            continue
        networks.append(f"{ip}/{ip.max_prefixlen}")
    return networks
