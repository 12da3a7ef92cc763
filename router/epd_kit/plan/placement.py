"""Where each engine's NeuronCore slice goes on one host.

Pinned slices stay; the rest is placed widest TP first at the lowest aligned start whose cores
are all free. With power-of-two TPs every aligned block of a narrow TP lies inside one aligned
block of a wider TP, so this greedy order finds a layout whenever one exists
(tests/unit/plan/test_properties.py checks it against brute force).
"""

from __future__ import annotations

from collections.abc import Mapping

from .command import ROLES
from .errors import EpdPlanError
from .hosts import HostSpec
from .settings import Settings
from .values import format_cores


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
            label = (
                f"{host.name}: epd_slices.{role}[{index}] = {start} (cores {format_cores(range(start, start + tp))})"
            )
            if start % tp:
                raise EpdPlanError(
                    f"{label} is misaligned: a tp={tp} slice must start at a multiple of {tp} "
                    f"(e.g. {start // tp * tp} or {start // tp * tp + tp}); on trn2 a misaligned slice compiles, then "
                    "fails in prefill warmup (REDUCE_SCATTER not supported)"
                )
            if start + tp > host.core_count:
                raise EpdPlanError(
                    f"{label} is over budget: the host has {host.core_count} cores (0-{host.core_count - 1})"
                )
            bad = [c for c in range(start, start + tp) if c in host.blocked]
            if bad:
                reasons = []
                if set(bad) & host.excluded_cores:
                    reasons.append(f"excluded {format_cores(set(bad) & host.excluded_cores)}")
                if set(bad) & host.faulted_cores:
                    reasons.append(f"faulted {format_cores(set(bad) & host.faulted_cores)}")
                raise EpdPlanError(
                    f"{label} uses unusable cores ({'; '.join(reasons)}); move it to a free aligned slice"
                )
            for core in range(start, start + tp):
                if core in owner:
                    raise EpdPlanError(f"{label} overlaps {owner[core]} on core {core}; slices must be disjoint")
                owner[core] = f"epd_slices.{role}[{index}]"
            pinned.setdefault(role, []).append(start)
    return pinned


def place(host: HostSpec, settings: Settings, counts: Mapping[str, int] | None = None) -> dict[str, list[int]] | None:
    """Slice starts per role, or None when the counts do not fit."""
    placed = _place_together(host, settings, [], counts)
    return None if placed is None else placed[None]


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


def no_fit_message(host: HostSpec, settings: Settings) -> str:
    blocked = host.blocked
    where = f"{host.usable_cores} usable cores"
    if blocked:
        where += f" (of {host.core_count}; excluded/faulted: {format_cores(blocked)})"
    fits = largest_fits(host, settings)
    what = " or ".join(f"{ve} VE + {pd} PD" for ve, pd in fits) + " fit" if fits else "no engine fits"
    return (
        f"{host.name}: layout does not fit: {where}: {what}, you asked for {host.num_ve} VE "
        f"(tp {settings.ve_tp}) + {host.num_pd} PD (tp {settings.pd_tp}). Lower epd_num_ve/"
        "epd_num_pd on that host (keep the TP: changing it invalidates the compile cache), "
        "free cores, or move engines to another host. Each slice needs tp free cores starting "
        "at a multiple of tp."
    )


def place_models(host: HostSpec, settings: Settings) -> dict[str | None, dict[str, list[int]]]:
    """Every model's slices on one host, by model key (models.fleet_models: None for models[0],
    epd_model with the host's counts). models[0]'s are where it is placed alone (`place`,
    hand-pinned slices kept); each epd_models entry (in order) then takes free aligned blocks of
    the cores left, widest TP first. So adding a model, or removing the last one, moves no engine
    already placed (a moved engine restarts). Only when that does not fit are all models placed
    together, widest TP first across models (a wide engine of one model then goes before a narrow
    one of another, which may move models[0]'s engines). A model that does not fit either way is
    refused naming it and the host; a host without a model's engines has no key for it."""
    others = [m for m in settings.models if m.runs_on(host.name) and (m.num_ve or m.num_pd)]
    alone = place(host, settings)  # models[0] alone first: not fitting is the one-model message
    if alone is None:
        raise EpdPlanError(no_fit_message(host, settings))
    if not others:
        return {None: alone}
    stable = _place_after(host, settings, alone, others)
    if stable is not None:
        return {None: alone, **stable}
    for upto in range(1, len(others) + 1):
        placed = _place_together(host, settings, others[:upto])
        if placed is None:
            model = others[upto - 1]
            before = [settings.model, *(m.name for m in others[: upto - 1])]
            raise EpdPlanError(model_no_fit_message(host, settings, model, before))
    assert placed is not None
    return placed


def _take(host: HostSpec, used: set[int], tp: int, count: int) -> list[int] | None:
    """`count` free aligned tp-core blocks, lowest first (marked used), or None."""
    starts: list[int] = []
    for start in range(0, host.core_count - tp + 1, tp):
        if len(starts) >= count:
            break
        block = range(start, start + tp)
        if used.isdisjoint(block):
            used.update(block)
            starts.append(start)
    return starts if len(starts) >= count else None


def _place_after(
    host: HostSpec, settings: Settings, placed: Mapping[str, list[int]], others
) -> dict[str | None, dict[str, list[int]]] | None:
    """The epd_models entries `others`, one after the other, on the cores models[0] (`placed`) leaves."""
    used = set(host.blocked)
    for role, starts in placed.items():
        for start in starts:
            used.update(range(start, start + settings.tp(role)))
    out: dict[str | None, dict[str, list[int]]] = {}
    for model in others:
        out[model.name] = {role: [] for role in ROLES}
        for role in sorted(ROLES, key=lambda r: (-model.settings.tp(r), r != "pd")):
            taken = _take(host, used, model.settings.tp(role), model.count(role))
            if taken is None:
                return None
            out[model.name][role] = taken
    return out


def _place_together(
    host: HostSpec, settings: Settings, others, counts: Mapping[str, int] | None = None
) -> dict[str | None, dict[str, list[int]]] | None:
    """Slice starts per model key (None: models[0], with `counts` or the host's) and role, or None
    when they do not fit; placement_order's rule (widest TP first, PD on a tie) across models."""
    counts = counts or {role: host.count(role) for role in ROLES}
    pinned = check_pinned(host, settings)
    used = set(host.blocked)
    for role, starts in pinned.items():
        for start in starts:
            used.update(range(start, start + settings.tp(role)))
    # (model position, model key, role, tp, count): models[0] is position 0 (key None)
    pools = [(0, None, role, settings.tp(role), counts[role]) for role in ROLES]
    pools += [(i + 1, m.name, role, m.settings.tp(role), m.count(role)) for i, m in enumerate(others) for role in ROLES]
    result: dict[str | None, dict[str, list[int]]] = {None: {role: list(pinned.get(role, [])) for role in ROLES}}
    for _, name, _, _, _ in pools:
        result.setdefault(name, {role: [] for role in ROLES})
    for _, name, role, tp, count in sorted(pools, key=lambda p: (-p[3], p[0], p[2] != "pd")):
        taken = _take(host, used, tp, count - len(result[name][role]))
        if taken is None:
            return None
        result[name][role] += taken
    return result


def model_no_fit_message(host: HostSpec, settings: Settings, model, before: list[str]) -> str:
    s = model.settings
    need = model.num_ve * s.ve_tp + model.num_pd * s.pd_tp
    first = host.num_ve * settings.ve_tp + host.num_pd * settings.pd_tp
    return (
        f"{host.name}: model {model.name} does not fit: it asks for {model.num_ve} VE (tp {s.ve_tp}) + "
        f"{model.num_pd} PD (tp {s.pd_tp}) = {need} cores beside {', '.join(before)} ({first} cores for "
        f"epd_model's {host.num_ve} VE + {host.num_pd} PD), on {host.usable_cores} usable cores. Lower its "
        "num_ve/num_pd in epd_models, run it on other hosts (its hosts list), or give the host more cores. "
        "Each slice needs tp free cores starting at a multiple of tp."
    )
