"""One engine host: its engine counts, core budget, exclusions and hand-pinned slices."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .command import ROLES
from .defaults import HOST_DEFAULTS
from .errors import EpdPlanError
from .settings import ID_PART, Settings
from .values import as_core_set, as_int, as_str, describe, format_cores


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
    # the host's part of its engine ids when the fleet has several engine hosts (epd-<label>-pd-0)
    id_label: str = ""

    def count(self, role: str) -> int:
        return self.num_ve if role == "ve" else self.num_pd

    @property
    def blocked(self) -> frozenset[int]:
        """Cores no slice may touch: excluded by the inventory or faulted (within the budget)."""
        return frozenset(c for c in self.excluded_cores | self.faulted_cores if c < self.core_count)

    @property
    def usable_cores(self) -> int:
        return self.core_count - len(self.blocked)


def check_bind_address(host: str, value: Any) -> str:
    address = as_str(f"{host}: epd_bind_address", value).strip()
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", address):
            raise EpdPlanError(
                f"{host}: epd_bind_address {address!r} is neither an IP address nor a host name"
            ) from None
        return address
    if ip.is_unspecified:
        raise EpdPlanError(
            f"{host}: epd_bind_address {address} is a wildcard; engines advertise this address to "
            "the router and (VE side channel) to PD engines, so set the host's own address"
        )
    return address


def check_id_label(host: str, value: Any) -> str:
    label = host if value is None else as_str(f"{host}: epd_engine_id_label", value).strip()
    if not ID_PART.fullmatch(label):
        raise EpdPlanError(
            f"{host}: the engine id label {label!r} must be letters, digits, '.', '_' or '-': set "
            "epd_engine_id_label of that host to one (the inventory name is the default)"
        )
    return label


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
            raise EpdPlanError(
                f"{name}: epd_slices must be a mapping like {{ve: [0, 4], pd: [8, 16]}}, got {describe(raw_slices)}"
            )
        unknown = sorted(set(map(str, raw_slices)) - set(ROLES))
        if unknown:
            raise EpdPlanError(f"{name}: epd_slices has unknown key(s) {', '.join(unknown)}; use ve and pd")
        slices = {}
        for role in ROLES:
            if role not in raw_slices or raw_slices[role] is None:
                continue
            entries = raw_slices[role]
            if not isinstance(entries, (list, tuple)):
                raise EpdPlanError(f"{name}: epd_slices.{role} must be a list of slice starts, got {describe(entries)}")
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
        id_label=check_id_label(name, variables.get("epd_engine_id_label")),
    )
