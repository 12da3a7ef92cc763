"""Checks for single inventory values: integers, strings, lists and core sets.

Inventory values arrive as Ansible wrapper types, as strings from `-e key=value`, or as plain
Python from tests; each check returns a plain value or raises EpdPlanError saying what is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import EpdPlanError

# a piece of an engine id (the prefix, a host's label, a model's name): ids key NIXL handshakes and unit names
ID_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def plain(value: Any) -> Any:
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
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    return value


def unresolved(value: Any) -> bool:
    """A value Ansible could not template (ansible-core 2.19 passes it on as a marker, jinja2's Undefined
    before): e.g. a fact on the controller, before any host is contacted."""
    name = type(value).__name__
    return name.endswith("Marker") or "Undefined" in name


def describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def as_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (or a string of digits, as `-e key=value` passes it) within bounds."""
    if isinstance(value, bool):
        raise EpdPlanError(f"{name} must be an integer, got {describe(value)}")
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        value = int(value)
    if not isinstance(value, int):
        raise EpdPlanError(f"{name} must be an integer, got {describe(value)}")
    if minimum is not None and value < minimum:
        raise EpdPlanError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise EpdPlanError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def as_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise EpdPlanError(f"{name} must be a string, got {describe(value)}")
    if CONTROL_CHARS.search(value):
        raise EpdPlanError(f"{name} must not contain control characters (newline, tab, ...): {value!r}")
    return str(value)


def as_str_list(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, Mapping)) or not isinstance(value, (list, tuple)):
        raise EpdPlanError(f"{name} must be a list of strings, got {describe(value)}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise EpdPlanError(f"{name}[{i}] must be a string, got {describe(item)}")
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
        raise EpdPlanError(f'{name} must be a list of core ids or "a-b" ranges, got {describe(value)}')
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
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(f"{start}-{prev}" if prev > start else f"{start}")
        if core is not None:
            start = prev = core
    return ", ".join(parts)


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0
