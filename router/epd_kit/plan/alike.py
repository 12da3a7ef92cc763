"""Router hosts alike: the settings every router host behind one front door must share.

The router variables are group-scoped (epd_router): each router host may set its own value, and
for what only that host sees (its listen address, its process count, its stop timeout) it should.
What decides a request's answer may not differ: clients reach any router host (a load balancer or
DNS picks one), so a request for one served name, one key or one image must get the same answer
from every one. ROUTER_ALIKE lists those variables with why; docs/planner.md "Router hosts
alike" lists the per-host ones and why they may differ. A value that differs is refused naming
the router hosts and what differs, never a key (the tenant keys are summarised by tenant).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .rules import Fleet, rule
from .variables import ROUTER, VARIABLES

ROUTER_ALIKE: dict[str, str] = {
    "epd_router_served_model_name": "a request's model picks the model by it: a router serving another name answers "
    "404 for it",
    "epd_router_api_keys_file": "a router without it (auth off) serves every client without a key",
    "epd_router_tenants": "a tenant's limits are its quota on every router",
    "epd_router_tenant_keys": "a key one router knows and another does not is refused (401) by half the routers, or "
    "served by a router with no key check and no quota",
    "epd_router_limits": "a limit decides whether a request is answered or refused (400, 413)",
    "epd_router_media": "which image URLs the router fetches decides whether a request is answered",
    "epd_router_draining": "a router that does not drain an engine keeps sending it requests",
}
# epd_router_extra_config sections that decide answers (the others tune one host: listen, health, ...)
EXTRA_ALIKE = ("limits", "media", "auth")
SECRET = frozenset({"epd_router_tenant_keys"})
# Ansible replaces a host's whole mapping or list with the host entry's own (hash_behaviour=replace)
REPLACES = (
    "a mapping or list set in one host's entry replaces the whole value of group_vars (Ansible does not merge them)"
)


def _unset(value: Any) -> bool:
    return value in (None, "", [], {})


def _shown(name: str, value: Any) -> str:
    """A value as the message shows it: the tenant keys as counts per tenant, never a key."""
    if _unset(value):
        return "unset"
    if name in SECRET:
        if not isinstance(value, list):
            return "not a list"
        per: dict[str, int] = {}
        for entry in value:
            tenant = str(entry.get("tenant")) if isinstance(entry, Mapping) else "?"
            per[tenant] = per.get(tenant, 0) + 1
        return f"{len(value)} key(s): " + ", ".join(f"{tenant} {count}" for tenant, count in per.items())
    return repr(value)


def _difference(name: str, values: Mapping[str, Any]) -> str:
    """What differs, host by host: a mapping's differing keys, else each host's value."""
    if name not in SECRET and all(isinstance(v, Mapping) or _unset(v) for v in values.values()):
        keys = sorted({str(k) for v in values.values() if isinstance(v, Mapping) for k in v})
        parts = []
        for key in keys:
            seen = {h: (v or {}).get(key) for h, v in values.items()}
            if len({repr(s) for s in seen.values()}) > 1:
                parts.append(f"{key}: " + ", ".join(f"{h} {_shown(name, s)}" for h, s in seen.items()))
        if parts:
            return "; ".join(parts[:4])
    return ", ".join(f"{h}: {_shown(name, v)}" for h, v in values.items())


def _value(fleet: Fleet, host: str, name: str) -> Any:
    value = fleet.values[host].get(name, VARIABLES[name].default)
    return None if _unset(value) else value


@rule(
    "router-hosts-alike",
    "clients reach any router host (the load balancer or DNS picks one): a setting that decides a request's "
    "answer must be the same on each, or half the requests get another answer",
)
def _router_hosts_alike(fleet: Fleet) -> Iterator[str]:
    routers = fleet.members(ROUTER)
    if len(routers) < 2:
        return
    checked = {name: {h: _value(fleet, h, name) for h in routers} for name in ROUTER_ALIKE}
    for section in EXTRA_ALIKE:
        extra = {h: (fleet.values[h].get("epd_router_extra_config") or {}) for h in routers}
        checked[f"epd_router_extra_config.{section}"] = {
            h: (e.get(section) if isinstance(e, Mapping) else None) or None for h, e in extra.items()
        }
    for name, values in checked.items():
        if len({repr(v) for v in values.values()}) < 2:
            continue
        why = ROUTER_ALIKE.get(name, "it decides whether a request is answered")
        kind = VARIABLES[name].kind if name in VARIABLES else "dict"
        replaced = f" ({REPLACES})" if kind in ("dict", "list", "any") else ""
        yield (
            f"{name} differs between the router hosts ({_difference(name, values)}): {why}; set it once for every "
            f"router host (group_vars/epd_router or group_vars/all){replaced}"
        )
