"""The router's tenants file from the inventory (docs/router.md "Tenants"): `epd_router_tenants`
(each tenant's limits) and `epd_router_tenant_keys` (each key and its tenant; keep the keys in a
vault). The role renders the text (`tenants_file_text`) into `epd_router_tenants_file`, root:epd
0640; the inventory check refuses what the router would (`tenant_problems`, with the parser the
router reads the file with, tenants_format.py), naming the inventory entry instead of a line,
never a key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .tenants_format import TENANT_NAME, parse_tenants

TENANTS, KEYS = "epd_router_tenants", "epd_router_tenant_keys"
_LINE = re.compile(r"line (\d+): ")
# errors name types and entries, never values: the keys' list holds secrets


def _lines(tenants: Any, keys: Any) -> tuple[list[str], list[str], list[str]]:
    """(file lines, the inventory entry of each, shape problems)."""
    lines, where, problems = ["# rendered by epd-kit from epd_router_tenants and epd_router_tenant_keys"], [""], []
    if not isinstance(tenants, Mapping):
        return lines, where, [f"{TENANTS} must be a mapping of tenant name to its limits, got {type(tenants).__name__}"]
    for name, given in tenants.items():
        limits = given or {}
        if not isinstance(limits, Mapping):
            problems.append(f"{TENANTS}.{name} must be a mapping of limits (or empty), got {type(limits).__name__}")
            continue
        lines.append(" ".join(["tenant", str(name), *(f"{key}={value}" for key, value in limits.items())]))
        where.append(f"{TENANTS}.{name}")
    if not isinstance(keys, list):
        return (
            lines,
            where,
            [
                *problems,
                f"{KEYS} must be a list of {{tenant: NAME, key: KEY}}, got {type(keys).__name__}",
            ],
        )
    for index, entry in enumerate(keys):
        if not (isinstance(entry, Mapping) and set(entry) == {"tenant", "key"}):
            problems.append(f"{KEYS}[{index}] must be {{tenant: NAME, key: KEY}} (exactly these two)")
            continue
        lines.append(f"key {entry['tenant']} {entry['key']}")
        where.append(f"{KEYS}[{index}]")
    return lines, where, problems


def tenants_file_text(tenants: Any, keys: Any) -> str:
    lines, _, _ = _lines(tenants or {}, keys or [])
    return "\n".join(lines) + "\n"


# render.yml's stand-in for each secret: the file is checkable (epd-router check-config reads it)
# but holds no key of the inventory; deploy writes the real file (tenants) or the operator does (API keys)
PLACEHOLDER = "RENDER-PLACEHOLDER-NOT-A-KEY"
PLACEHOLDER_NOTE = (
    "# PLACEHOLDER written by render.yml: the keys below are stand-ins, not the inventory's; "
    "{what} writes the real file on the router host"
)


def placeholder_tenants_text(tenants: Any, keys: Any) -> str:
    """The tenants file as the role renders it, each key replaced by a numbered placeholder."""
    stand_ins = [
        {"tenant": entry.get("tenant"), "key": f"{PLACEHOLDER}-tenant-{index}"} if isinstance(entry, Mapping) else entry
        for index, entry in enumerate(keys or [])
    ]
    text = tenants_file_text(tenants, stand_ins)
    return PLACEHOLDER_NOTE.format(what="deploy.yml (from epd_router_tenant_keys)") + "\n" + text


def placeholder_api_keys_text(path: str) -> str:
    """An API keys file with one placeholder key: the kit never writes the real one at `path`
    (epd_router_api_keys_file: the operator puts it there, 0600)."""
    note = PLACEHOLDER_NOTE.format(what=f"the operator (the kit never writes epd_router_api_keys_file {path})")
    return f"{note}\n{PLACEHOLDER}-api-0\n"


def tenant_problems(values: Mapping[str, Any]) -> list[str]:
    """What the router would refuse in the file rendered from one router host's `values` (its
    explicitly set variables); [] without tenant keys."""
    tenants, keys = values.get(TENANTS) or {}, values.get(KEYS) or []
    if (not tenants and not keys) or not isinstance(tenants, Mapping):  # the variable's own check names that
        return []
    lines, where, problems = _lines(tenants, keys)
    if problems:
        return problems
    if any("\n" in line or "\r" in line for line in lines):
        return [f"{TENANTS}/{KEYS}: a name, limit or key spans lines"]
    # a name the file would split (a space) is the name's fault, not an unknown limit's
    names = [
        f"{TENANTS}.{name}: the tenant name {str(name)[:64]!r} must be 1-63 characters of [A-Za-z0-9_.-] (the "
        "router's tenants file separates a name from its limits by spaces)"
        for name in tenants
        if not TENANT_NAME.match(str(name))
    ]
    if names:
        return names
    try:
        parse_tenants("\n".join(lines), "tenants")
    except ValueError as error:
        text = str(error).removeprefix("tenants: ").replace("in this file", f"in {TENANTS}")
        found = _LINE.match(text)
        if found is None:
            return [f"{KEYS}: {text}"]
        entry, rest = where[int(found.group(1)) - 1], text[found.end() :]
        same = _SAME.match(rest)
        if same:  # both entries, each with its tenant: which is stale is the operator's call
            first = where[int(same.group(1)) - 1]
            return [
                f"{first} (tenant {_tenant(keys, first)}) and {entry} (tenant {_tenant(keys, entry)}) hold the same "
                f"key: a key belongs to one tenant; remove the stale entry"
            ]
        return [f"{entry}: {rest}"]
    return []


_SAME = re.compile(r"the same key as line (\d+)$")


def _tenant(keys: list[Any], entry: str) -> str:
    index = int(entry.removeprefix(f"{KEYS}[").rstrip("]"))
    return str(keys[index]["tenant"])


# A client key is the only thing between a client network and the fleet. No source sets a minimum
# for bearer keys; the safe side: 16 characters (at most ~100 bits even when random) and 8
# different characters, below which a key is guessed or was typed as a placeholder.
MIN_KEY_LENGTH, MIN_KEY_CHARACTERS = 16, 8
KEY_FIX = "make one with: openssl rand -hex 24"


def key_strength_problems(values: Mapping[str, Any]) -> list[str]:
    """The client keys the inventory holds (epd_router_tenant_keys, epd_router_api_key) that are too
    short or too plain, named by their entry, never shown."""
    named: list[tuple[str, Any]] = []
    keys = values.get(KEYS)
    if isinstance(keys, list):
        named += [(f"{KEYS}[{i}]", e.get("key")) for i, e in enumerate(keys) if isinstance(e, Mapping)]
    if values.get("epd_router_api_key"):
        named.append(("epd_router_api_key", values["epd_router_api_key"]))
    problems = []
    for where, key in named:
        if not isinstance(key, str):
            continue
        if len(key) < MIN_KEY_LENGTH:
            problems.append(
                f"{where}: the key has {len(key)} characters, fewer than {MIN_KEY_LENGTH}: a client key is all that "
                f"stands between the client networks and the fleet, and a short one is guessed; {KEY_FIX}"
            )
        elif len(set(key)) < MIN_KEY_CHARACTERS:
            problems.append(
                f"{where}: the key has only {len(set(key))} different characters (fewer than {MIN_KEY_CHARACTERS}): "
                f"a placeholder or a pattern, not a secret; {KEY_FIX}"
            )
    return problems
