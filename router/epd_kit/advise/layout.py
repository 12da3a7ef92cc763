"""The recommendation: VE and PD counts per host on the same hosts and cores, chosen under the
queueing model and accepted only if the planner plans it and the rollout floors hold.

Search: the smallest change, counted in engines added or removed, that brings every pool to or
under both targets, the busy fraction (--target-busy, 70 % by default) and the share of its time
in stage spent queueing (--target-queueing, 50 %: queueing no longer than service), without
making the modelled mean latency worse; among changes of that size, the one that leaves the busiest pool
least busy. The model sees only the pools' sizes, so for every pair of pool sizes one dynamic
program over the hosts finds the fewest engine changes reaching it (each host taking any VE/PD
counts the planner's placement fits on it). When no layout of these hosts reaches the target,
the least busy one that lowers the busiest pool by at least MIN_GAIN (the load needs every
engine it moves). Hosts with hand-pinned slices (epd_slices) keep their engines. The proposal
states its headroom (how far the load can grow before the busiest pool passes the target) and
the next step (the smallest change that meets the target again at that load).

Several models (epd_models): one Advisor per model, each reading its own model's series and
moving only its own engines: models[0]'s (epd_model, plan/models.py fleet_models) per host
(epd_num_ve / epd_num_pd), an epd_models entry's through that entry (num_ve / num_pd, the
same on every host it runs on). A layout that would move another model's engine (a slice or
port of it changes) is refused, naming the engine; the report says which better layout was refused for it.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from epd_kit.plan import ROLES, EpdPlanError, check_inventory, fleet_settings, place, plan_table, read_host
from epd_kit.plan.checks import ENGINE_GROUP, ROUTER_GROUP, text_only
from epd_kit.plan.defaults import HOST_DEFAULTS
from epd_kit.plan.models import ModelSpec
from epd_kit.plan.rollout import PoolRule, resolve_pool
from epd_kit.plan.values import format_cores

from .analysis import DEFAULT_TARGET_BUSY, DEFAULT_TARGET_QUEUEING, Analysis
from .queueing import PoolModel

# A change that cannot reach the target must lower the busiest pool's utilisation by this share,
# or it is noise.
MIN_GAIN = 0.10
# A change may not raise the modelled mean latency by more than this share.
LATENCY_SLACK = 0.02
# Engines added or removed that one recommendation may propose (bounds the search on big fleets).
MAX_CHANGES = 32


class InventoryError(ValueError):
    """The inventory cannot be read or does not plan: the message says why."""


@dataclass(frozen=True)
class Inventory:
    """`ansible-inventory --list` output: every host's variables and the groups' hosts."""

    hostvars: dict[str, dict[str, Any]]
    groups: dict[str, list[str]]


def _group_hosts(doc: Mapping[str, Any], group: str, seen: frozenset[str] = frozenset()) -> list[str]:
    entry = doc.get(group) or {}
    hosts = list(entry.get("hosts", []))
    for child in entry.get("children", []):
        if child not in seen:
            hosts += [h for h in _group_hosts(doc, child, seen | {group}) if h not in hosts]
    return hosts


def inventory_from_json(doc: Mapping[str, Any], source: str) -> Inventory:
    if not isinstance(doc, Mapping) or "_meta" not in doc:
        raise InventoryError(f"{source}: not `ansible-inventory --list` output (no _meta)")
    groups = {name: _group_hosts(doc, name) for name in doc if name != "_meta"}
    return Inventory(dict(doc["_meta"].get("hostvars", {})), groups)


def load_inventory(path: Path) -> Inventory:
    """A saved `ansible-inventory --list` JSON file, or an inventory (file or directory) that
    ansible-inventory resolves (group_vars and host_vars included)."""
    if path.is_file() and path.suffix == ".json":
        try:
            return inventory_from_json(json.loads(path.read_text()), str(path))
        except (OSError, ValueError) as exc:
            raise InventoryError(f"cannot read {path}: {exc}") from None
    tool = shutil.which("ansible-inventory")
    if tool is None:
        raise InventoryError(
            f"ansible-inventory is not on PATH to read {path}: run `ansible-inventory -i {path} --list > inv.json` "
            "where Ansible is installed and pass --inventory inv.json"
        )
    done = subprocess.run([tool, "-i", str(path), "--list"], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise InventoryError(f"ansible-inventory -i {path} --list failed: {done.stderr.strip()[:500]}")
    return inventory_from_json(json.loads(done.stdout), str(path))


@dataclass(frozen=True)
class Layout:
    counts: dict[str, tuple[int, int]]  # host -> (VE, PD)
    # an epd_models entry's model: that entry ("epd_models[0] (text)"), whose num_ve / num_pd
    # are the counts on every host it runs on; None: models[0]'s (epd_model), per host
    entry: str | None = None

    def total(self, role: str) -> int:
        return sum(ve if role == "ve" else pd for ve, pd in self.counts.values())

    def changes_from(self, other: Layout) -> int:
        """Engines added or removed to go from `other` to this layout."""
        return sum(abs(a - b) for h, now in self.counts.items() for a, b in zip(now, other.counts[h], strict=True))

    def inventory_change(self, other: Layout) -> list[str]:
        """The inventory lines that turn `other` into this layout."""
        if self.entry is not None:
            (ve, pd), (old_ve, old_pd) = next(iter(self.counts.values())), next(iter(other.counts.values()))
            if (ve, pd) == (old_ve, old_pd):
                return []
            return [f"{self.entry}: num_ve {old_ve} -> {ve}, num_pd {old_pd} -> {pd}"]
        lines = []
        for host, (ve, pd) in self.counts.items():
            old_ve, old_pd = other.counts[host]
            if (ve, pd) != (old_ve, old_pd):
                lines.append(f"{host}: epd_num_ve {old_ve} -> {ve}, epd_num_pd {old_pd} -> {pd}")
        return lines


@dataclass(frozen=True)
class Prediction:
    """A layout under the model at the measured load (times `load`)."""

    ve: PoolModel
    pd: PoolModel
    image_share: float  # requests that encode
    load: float = 1.0

    @property
    def busiest(self) -> float:
        return max(p.utilisation if p.rate > 0 else 0.0 for p in (self.ve, self.pd))

    @property
    def busiest_role(self) -> str:
        return "ve" if self.ve.rate > 0 and self.ve.utilisation >= self.pd.utilisation else "pd"

    def pool(self, role: str) -> PoolModel:
        return self.ve if role == "ve" else self.pd

    def queueing_share(self, role: str) -> float:
        """The share of `role`'s modelled time in stage spent queueing (1 past capacity)."""
        pool = self.pool(role)
        if pool.rate <= 0:
            return 0.0
        time = pool.time_in_stage_s
        return 1.0 if math.isinf(time) else (pool.queueing_s / time if time > 0 else 0.0)

    @property
    def most_queueing(self) -> float:
        return max(self.queueing_share(role) for role in ROLES)

    def meets(self, target: float, target_queueing: float) -> bool:
        """Every pool at or under the busy target and the queueing target."""
        return self.busiest <= target and self.most_queueing <= target_queueing

    def scaled(self, load: float) -> Prediction:
        """This layout at `load` times this prediction's load."""
        return Prediction(self.ve.scaled(load), self.pd.scaled(load), self.image_share, self.load * load)

    @property
    def mean_s(self) -> float:
        """Mean modelled time in VE (image requests) plus PD per request."""
        ve = self.ve.time_in_stage_s * self.image_share if self.ve.rate > 0 else 0.0
        return ve + self.pd.time_in_stage_s

    @property
    def max_rate(self) -> float:
        """Requests/s this layout completes at this traffic mix (its busiest pool at utilisation 1)."""
        total = self.pd.rate
        if total <= 0:
            return math.inf
        return min(p.capacity_per_s * total / p.rate for p in (self.ve, self.pd) if p.rate > 0)

    def headroom(self, target: float, target_queueing: float = DEFAULT_TARGET_QUEUEING) -> float:
        """How many times this load the layout takes before a pool passes `target` busy (busy
        fractions grow in proportion to the load) or `target_queueing` (queueing shares grow
        with it too: bisection); below 1 when it is past one already."""
        if self.busiest <= 0:
            return math.inf
        low, high = 0.0, target / self.busiest
        if self.scaled(high).most_queueing <= target_queueing:
            return high
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if self.scaled(mid).most_queueing <= target_queueing else (low, mid)
        return low


@dataclass(frozen=True)
class NextStep:
    """What to change once the load outgrows the proposal: at `prediction.load` times today's
    load the proposal's busiest pool reaches the target; `layout` meets it again (None: no
    layout of these hosts does, the fleet needs another host)."""

    layout: Layout | None
    prediction: Prediction | None
    load: float


@dataclass(frozen=True)
class Recommendation:
    current: Layout
    proposed: Layout
    before: Prediction
    after: Prediction
    plan_lines: list[str]  # the planner's table of the proposed layout
    reason: str
    target: float = DEFAULT_TARGET_BUSY
    next_step: NextStep | None = None  # None when the load cannot grow (no traffic) or past target
    # a better-ranked layout refused because it would move another model's engine (why, and
    # what it would have changed); None: none was
    refused: str | None = None
    target_queueing: float = DEFAULT_TARGET_QUEUEING
    # the targets are missed and no layout of these hosts helps enough: the fleet needs a host
    needs_hosts: bool = False
    measured_ttft_s: float = 0.0  # the window's mean TTFT

    @property
    def predicted_ttft_s(self) -> float:
        """The mean TTFT under the proposal: today's less the modelled time in VE and PD it saves
        (service is unchanged, so what changes is queueing, which comes before the first token)."""
        return max(0.0, self.measured_ttft_s + self.after.mean_s - self.before.mean_s)

    @property
    def changed(self) -> bool:
        return self.proposed != self.current

    @property
    def action(self) -> str:
        """ "change" (the proposed layout), "add a host" (none of these hosts' layouts helps
        enough), or "none" (every pool within both targets, or no pool busy)."""
        return "change" if self.changed else "add a host" if self.needs_hosts else "none"

    @property
    def headroom(self) -> float:
        return self.after.headroom(self.target, self.target_queueing)

    def inventory_change(self) -> list[str]:
        return self.proposed.inventory_change(self.current)


def first_model_name(inventory: Inventory, settings: Any) -> str:
    """models[0]'s served name (the router's `model` label): epd_router_served_model_name
    of the router hosts, else its checkpoint (epd_model), as the router's config says."""
    for host in inventory.groups.get(ROUTER_GROUP, []):
        name = inventory.hostvars.get(host, {}).get("epd_router_served_model_name")
        if name:
            return str(name)
    return settings.model


class Advisor:
    """The planner's view of the inventory and the moves it allows, for one model of the fleet
    (`model`: an epd_models entry's served name; None: models[0], epd_model)."""

    def __init__(
        self, inventory: Inventory, faulted: Mapping[str, list[int]] | None = None, model: str | None = None
    ) -> None:
        self.inventory, self.faulted = inventory, dict(faulted or {})
        checked = self._check(inventory.hostvars)
        if checked["problems"]:
            raise InventoryError("the inventory does not plan: " + "; ".join(checked["problems"]))
        self.plan = checked["plan"]
        self.fleet_hosts = [str(h) for h in inventory.groups.get(ENGINE_GROUP, [])]
        try:
            self.fleet = fleet_settings(inventory.hostvars, self.fleet_hosts)
            fleet_text_only = text_only(inventory.hostvars, self.fleet_hosts)
        except EpdPlanError as exc:
            raise InventoryError(str(exc)) from None
        self.spec: ModelSpec | None = None
        if model is not None:
            self.spec = next((m for m in self.fleet.models if m.name == model), None)
            if self.spec is None:
                raise InventoryError(f"no model {model!r} in epd_models")
        self.index = None if self.spec is None else self.fleet.models.index(self.spec)
        self.several = bool(self.fleet.models)
        # this model's settings (TPs, max_num_seqs, checkpoint) and hosts
        self.settings = self.fleet if self.spec is None else self.spec.settings
        self.text_only = fleet_text_only if self.spec is None else self.spec.text_only
        self.name = first_model_name(inventory, self.fleet) if self.spec is None else self.spec.name
        self.engine_hosts = [h for h in self.fleet_hosts if self.spec is None or self.spec.runs_on(h)]
        counts = {h: [0, 0] for h in self.engine_hosts}
        for host, host_plan in self.plan.items():
            for engine in host_plan["engines"]:
                if self._mine(engine):
                    counts[host][ROLES.index(engine["role"])] += 1
        entry = None if self.spec is None else f"epd_models[{self.index}] ({self.spec.name})"
        self.current = Layout({h: (c[0], c[1]) for h, c in counts.items()}, entry)
        first = inventory.hostvars[self.fleet_hosts[0]]
        self.min_available = {role: first.get(f"epd_rollout_min_available_{role}") for role in ROLES}
        self.batch = {role: first.get(f"epd_rollout_batch_{role}", 1) for role in ROLES}
        self._refused: list[str] = []

    @classmethod
    def per_model(cls, inventory: Inventory, faulted: Mapping[str, list[int]] | None = None) -> list[Advisor]:
        """One advisor per model of the fleet, in the fleet's order (models[0], epd_model, first)."""
        first = cls(inventory, faulted)
        return [first] + [cls(inventory, faulted, spec.name) for spec in first.fleet.models]

    def _mine(self, engine: Mapping[str, Any]) -> bool:
        return engine.get("model") == (None if self.spec is None else self.spec.name)

    @property
    def checkpoint(self) -> str:
        return self.settings.model

    @property
    def pd_slots(self) -> int:
        return self.settings.max_num_seqs

    def _check(self, hostvars: Mapping[str, Any]) -> dict[str, Any]:
        return check_inventory(hostvars, self.inventory.groups, self.faulted)

    def host_options(self, host: str) -> list[tuple[int, int]]:
        """Every (VE, PD) the planner's placement fits on `host` (only its own counts if pinned),
        this model's engines alone on it (the whole plan is checked in `refusal`)."""
        variables = self.inventory.hostvars[host]
        if variables.get("epd_slices") and self.spec is None:
            return [self.current.counts[host]]
        spec = read_host(
            host, {k: variables[k] for k in HOST_DEFAULTS if k in variables}, self.settings, self.faulted.get(host, ())
        )
        ve_max = 0 if self.text_only else spec.core_count // self.settings.ve_tp
        return [
            (ve, pd)
            for ve in range(0 if self.spec is None else int(not self.text_only), ve_max + 1)
            for pd in range(0 if self.spec is None else 1, spec.core_count // self.settings.pd_tp + 1)
            if place(replace(spec, num_ve=ve, num_pd=pd, slices=None), self.settings, {"ve": ve, "pd": pd}) is not None
        ]

    def rule(self, role: str, size: int, *, batch: int | None = None, floor: int | None = None) -> PoolRule:
        """This model's `role` pool of `size` as a rollout resolves it (rollout.resolve_pool: an
        epd_models entry's own rollout_batch_* / rollout_min_available_* over the fleet's);
        `batch`, `floor`: a value in place of the configured one."""
        key = None if self.spec is None else self.spec.name
        given = {f"rollout_batch_{role}": batch, f"rollout_min_available_{role}": floor}
        given = {k: v for k, v in given.items() if v is not None}
        entries = [{**m.as_dict(), **(given if m.name == key else {})} for m in self.fleet.models]
        sizes = {**self.batch, **({role: batch} if batch is not None else {})}
        floors = {**self.min_available, **({role: floor} if floor is not None else {})}
        return resolve_pool(role, key, size, sizes, floors, entries)

    def floor(self, role: str) -> int:
        """Engines of `role` that must stay in rotation: today's rollout floor of this model's
        pool (at least one engine for a pool that exists: a model serving images needs a VE,
        every model a PD)."""
        size = self.current.total(role)
        if size == 0:
            return 0
        try:
            floor = self.rule(role, size, batch=1).floor
        except EpdPlanError:
            floor = size - 1  # today's setting cannot roll the pool: keep all but one
        return max(floor, 1)

    def refusal(self, layout: Layout) -> str | None:
        """Why the planner or the rollout rules refuse `layout` (None: accepted). A new pool
        keeps today's floor in rotation while it rolls in its batches; a pool of one today
        (floor 0: it leaves rotation to restart) may stay one."""
        for role in ROLES:
            size, floor = layout.total(role), self.floor(role)
            if size < floor:
                return f"a {role.upper()} pool of {size} is below its floor of {floor}"
            if size and self.current.total(role) > 1:
                try:
                    self.rule(role, size, floor=floor)
                except EpdPlanError as exc:
                    return str(exc)
        checked = self._check(self.hostvars_for(layout))
        if checked["problems"]:
            return "; ".join(checked["problems"])
        return self.moved_engine(layout, checked["plan"]) if self.several else None

    def moved_engine(self, layout: Layout, plan: Mapping[str, Any]) -> str | None:
        """Why `layout` is refused if its plan moves or removes another model's engine (None:
        every other model's engine keeps its host, cores and port)."""
        now = {
            e["engine_id"]: (host, e["cores"], e["port"])
            for host, host_plan in plan.items()
            for e in host_plan["engines"]
        }
        for host, host_plan in self.plan.items():
            for engine in host_plan["engines"]:
                if self._mine(engine):
                    continue
                was = (host, engine["cores"], engine["port"])
                if now.get(engine["engine_id"]) != was:
                    owner = engine.get("model") or first_model_name(self.inventory, self.fleet)
                    where = now.get(engine["engine_id"])
                    moved = (
                        "out of the plan"
                        if where is None
                        else f"from {host} cores {format_cores(was[1])} port {was[2]} to {where[0]} cores "
                        f"{format_cores(where[1])} port {where[2]}"
                    )
                    change = "; ".join(layout.inventory_change(self.current))
                    return (
                        f"{change} would move model {owner}'s engine {engine['engine_id']} {moved}: the advisor "
                        f"changes model {self.name}'s engines only (move {owner}'s on purpose, or add a host)"
                    )
        return None

    def hostvars_for(self, layout: Layout) -> dict[str, dict[str, Any]]:
        hostvars = copy.deepcopy(self.inventory.hostvars)
        if self.spec is None:
            for host, (ve, pd) in layout.counts.items():
                hostvars[host]["epd_num_ve"], hostvars[host]["epd_num_pd"] = ve, pd
            return hostvars
        ve, pd = next(iter(layout.counts.values()))
        for variables in hostvars.values():
            models = variables.get("epd_models")
            if isinstance(models, list) and len(models) > self.index:
                models[self.index] = {**models[self.index], "num_ve": ve, "num_pd": pd}
        return hostvars

    def plan_lines(self, layout: Layout) -> list[str]:
        checked = self._check(self.hostvars_for(layout))
        return plan_table(checked["plan"])

    def predict(self, analysis: Analysis, layout: Layout, load: float = 1.0) -> Prediction:
        ve, pd = analysis.pools["ve"], analysis.pools["pd"]
        share = analysis.image_requests / pd.arrivals if pd.arrivals > 0 else 0.0
        return Prediction(
            ve.model.scaled(load).with_servers(layout.total("ve")),
            pd.model.scaled(load).with_servers(layout.total("pd") * pd.slots_per_engine),
            min(1.0, share),
            load,
        )

    def recommend(
        self,
        analysis: Analysis,
        target: float = DEFAULT_TARGET_BUSY,
        target_queueing: float = DEFAULT_TARGET_QUEUEING,
    ) -> Recommendation | None:
        """None when the window cannot support a recommendation (too little traffic). A verdict
        that names a bottleneck is acted on when a pool is over the busy target or its requests
        queue over the queueing target (measured); "no change" only when neither holds."""
        if not analysis.enough_traffic:
            return None
        self._refused = []
        targets = (target, target_queueing)
        before = self.predict(analysis, self.current)
        options = {host: self.host_options(host) for host in self.engine_hosts}
        why = self._why(analysis, before, *targets)
        if analysis.bottleneck is None or why is None:
            reason = analysis.verdict() if analysis.bottleneck is None else self._within(analysis, *targets)
            return self._recommendation(analysis, self.current, before, before, reason, targets, options)
        found = self._smallest_change(analysis, self.current, before, targets, options)
        if found is not None:
            layout, after = found
            reason = (
                f"{why}: the fewest engine changes ({layout.changes_from(self.current)}) that bring every pool to or "
                f"under {target:.0%} busy and {target_queueing:.0%} of its time queueing"
            )
            return self._recommendation(analysis, layout, before, after, reason, targets, options)
        found = self._least_busy(analysis, before, options)
        if found is None:
            reason = f"{why}, and no layout the planner accepts lowers the busiest pool's load enough: add a host"
            return self._recommendation(analysis, self.current, before, before, reason, targets, options, True)
        layout, after = found
        reason = (
            f"{why}, and no layout of these hosts brings every pool within the targets: this one is the least "
            "busy (every engine it moves is needed); more hosts reach the target"
        )
        return self._recommendation(analysis, layout, before, after, reason, targets, options, True)

    @staticmethod
    def _why(analysis: Analysis, before: Prediction, target: float, target_queueing: float) -> str | None:
        """Why the layout must change: the pools over a target, measured (None: none is)."""
        parts = []
        for p in analysis.waiting(target_queueing):
            times = p.queueing_s / p.model.service_s if p.model.service_s > 0 else math.inf
            parts.append(
                f"requests wait {p.queueing_s:.3f} s in front of the {p.role.upper()} pool, {times:.1f}x its "
                f"{p.model.service_s:.3f} s service ({p.queueing_share:.0%} of their time there, over the "
                f"{target_queueing:.0%} queueing target)"
            )
        if before.busiest > target:
            parts.insert(
                0, f"the {before.busiest_role.upper()} pool is {before.busiest:.0%} busy, over the {target:.0%} target"
            )
        return "; ".join(parts) or None

    @staticmethod
    def _within(analysis: Analysis, target: float, target_queueing: float) -> str:
        """No change for a named bottleneck: in words that agree with the verdict."""
        role = analysis.bottleneck or "ve"
        pool = analysis.pools[role]
        return (
            f"the {role.upper()} pool bounds throughput, but it is {pool.busy:.0%} busy and its requests queue "
            f"{pool.queueing_s:.3f} s, {pool.queueing_share:.0%} of their time there: within the {target:.0%} busy "
            f"and {target_queueing:.0%} queueing targets, so more engines would shorten a request by at most that "
            "queueing"
        )

    def _recommendation(
        self,
        analysis: Analysis,
        layout: Layout,
        before: Prediction,
        after: Prediction,
        reason: str,
        targets: tuple[float, float],
        options: Mapping[str, list[tuple[int, int]]],
        needs_hosts: bool = False,
    ) -> Recommendation:
        refused = self._refused[0] if self._refused else None
        next_step = None
        load = after.headroom(*targets)
        if 1 <= load < math.inf:
            at_load = self.predict(analysis, layout, load)
            found = self._smallest_change(analysis, layout, at_load, targets, options)
            next_step = NextStep(*(found or (None, None)), load)
        plan = self.plan_lines(layout)
        target, target_queueing = targets
        return Recommendation(
            self.current,
            layout,
            before,
            after,
            plan,
            reason,
            target,
            next_step,
            refused,
            target_queueing=target_queueing,
            needs_hosts=needs_hosts,
            measured_ttft_s=analysis.stages.ttft_s,
        )

    def _smallest_change(
        self,
        analysis: Analysis,
        base: Layout,
        now: Prediction,
        targets: tuple[float, float],
        options: Mapping[str, list[tuple[int, int]]],
    ) -> tuple[Layout, Prediction] | None:
        """The fewest engine changes from `base` (at `now`'s load) whose every pool meets
        `targets` (busy, queueing share) and whose mean time is not worse; of those, the least busy."""
        candidates = []
        for layout in self._cheapest_layouts(base, options):
            predicted = self.predict(analysis, layout, now.load)
            if layout == base or not predicted.meets(*targets) or predicted.mean_s > now.mean_s * (1 + LATENCY_SLACK):
                continue
            candidates.append((layout.changes_from(base), predicted.busiest, predicted.mean_s, layout, predicted))
        return self._first_accepted(candidates)

    def _least_busy(
        self, analysis: Analysis, now: Prediction, options: Mapping[str, list[tuple[int, int]]]
    ) -> tuple[Layout, Prediction] | None:
        """The least busy layout that lowers the busiest pool by MIN_GAIN at no worse mean time;
        of equally busy ones, the fewest changes."""
        candidates = []
        for layout in self._cheapest_layouts(self.current, options):
            predicted = self.predict(analysis, layout)
            if predicted.busiest > now.busiest * (1 - MIN_GAIN) or predicted.mean_s > now.mean_s * (1 + LATENCY_SLACK):
                continue
            changes = layout.changes_from(self.current)
            candidates.append((predicted.busiest, changes, predicted.mean_s, layout, predicted))
        return self._first_accepted(candidates)

    def _first_accepted(self, candidates: list[tuple]) -> tuple[Layout, Prediction] | None:
        """The best-ranked candidate the planner and the rollout rules accept; a better one
        refused for moving another model's engine is kept to be reported."""
        for *_, layout, predicted in sorted(candidates, key=lambda c: (*c[:3], sorted(c[3].counts.items()))):
            why = self.refusal(layout)
            if why is None:
                return layout, predicted
            if self.several and " would move model " in why:
                self._refused.append(why)
        return None

    def _cheapest_layouts(self, base: Layout, options: Mapping[str, list[tuple[int, int]]]) -> list[Layout]:
        """For every pair of pool sizes the hosts can hold within MAX_CHANGES of `base`, the layout
        reaching it with the fewest engine changes (the model sees only the pools' sizes): one
        pass over the hosts, keeping per (VE total, PD total) the cheapest counts so far. An
        epd_models entry's counts are its own, the same on each of its hosts."""
        if self.spec is not None:
            shared = set.intersection(*(set(options[h]) for h in self.engine_hosts))
            layouts = [Layout(dict.fromkeys(self.engine_hosts, counts), base.entry) for counts in sorted(shared)]
            return [layout for layout in layouts if layout.changes_from(base) <= MAX_CHANGES]
        best: dict[tuple[int, int], tuple[int, dict[str, tuple[int, int]]]] = {(0, 0): (0, {})}
        for host in self.engine_hosts:
            old_ve, old_pd = base.counts[host]
            grown: dict[tuple[int, int], tuple[int, dict[str, tuple[int, int]]]] = {}
            for (ve_total, pd_total), (cost, counts) in best.items():
                for ve, pd in options[host]:
                    step = cost + abs(ve - old_ve) + abs(pd - old_pd)
                    key = (ve_total + ve, pd_total + pd)
                    if step <= MAX_CHANGES and (key not in grown or step < grown[key][0]):
                        grown[key] = (step, {**counts, host: (ve, pd)})
            best = grown
        return [Layout(counts) for _, counts in best.values()]
