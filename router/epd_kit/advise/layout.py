"""The recommendation: VE and PD counts per host on the same hosts and cores, chosen under the
queueing model and accepted only if the planner plans it and the rollout floors hold.

Search: from the deployed layout, repeatedly take the single-host change (any VE/PD counts the
planner's placement fits on that host) that lowers the busiest pool's modelled utilisation the
most, as long as it lowers it by at least MIN_GAIN and does not make the modelled mean latency
worse. Hosts with hand-pinned slices (epd_slices) keep their engines.
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

from epd_kit.plan import EpdPlanError, check_inventory, fleet_settings, place, plan_table, read_host
from epd_kit.plan.checks import ENGINE_GROUP, text_only
from epd_kit.plan.defaults import HOST_DEFAULTS
from epd_kit.plan.rollout import PoolRule

from .analysis import Analysis
from .queueing import PoolModel

ROLES = ("ve", "pd")
# A change must lower the busiest pool's utilisation by this share, or it is noise.
MIN_GAIN = 0.10
# ... and may not raise the modelled mean latency by more than this share.
LATENCY_SLACK = 0.02
MAX_STEPS = 10


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

    def total(self, role: str) -> int:
        return sum(ve if role == "ve" else pd for ve, pd in self.counts.values())


@dataclass(frozen=True)
class Prediction:
    """A layout under the model at the measured load."""

    ve: PoolModel
    pd: PoolModel
    image_share: float  # requests that encode

    @property
    def busiest(self) -> float:
        return max(p.utilisation if p.rate > 0 else 0.0 for p in (self.ve, self.pd))

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


@dataclass(frozen=True)
class Recommendation:
    current: Layout
    proposed: Layout
    before: Prediction
    after: Prediction
    plan_lines: list[str]  # the planner's table of the proposed layout
    reason: str

    @property
    def changed(self) -> bool:
        return self.proposed != self.current

    def inventory_change(self) -> list[str]:
        lines = []
        for host, (ve, pd) in self.proposed.counts.items():
            old_ve, old_pd = self.current.counts[host]
            if (ve, pd) != (old_ve, old_pd):
                lines.append(f"{host}: epd_num_ve {old_ve} -> {ve}, epd_num_pd {old_pd} -> {pd}")
        return lines


class Advisor:
    """The planner's view of the inventory and the moves it allows."""

    def __init__(self, inventory: Inventory, faulted: Mapping[str, list[int]] | None = None) -> None:
        self.inventory, self.faulted = inventory, dict(faulted or {})
        checked = self._check(inventory.hostvars)
        if checked["problems"]:
            raise InventoryError("the inventory does not plan: " + "; ".join(checked["problems"]))
        self.engine_hosts = [str(h) for h in inventory.groups.get(ENGINE_GROUP, [])]
        try:
            self.settings = fleet_settings(inventory.hostvars, self.engine_hosts)
            self.text_only = text_only(inventory.hostvars, self.engine_hosts)
        except EpdPlanError as exc:
            raise InventoryError(str(exc)) from None
        counts = {h: [0, 0] for h in self.engine_hosts}
        for host, host_plan in checked["plan"].items():
            for engine in host_plan["engines"]:
                counts[host][ROLES.index(engine["role"])] += 1
        self.current = Layout({h: (c[0], c[1]) for h, c in counts.items()})
        first = inventory.hostvars[self.engine_hosts[0]]
        self.min_available = {role: first.get(f"epd_rollout_min_available_{role}") for role in ROLES}
        self.batch = {role: first.get(f"epd_rollout_batch_{role}", 1) for role in ROLES}

    @property
    def pd_slots(self) -> int:
        return self.settings.max_num_seqs

    def _check(self, hostvars: Mapping[str, Any]) -> dict[str, Any]:
        return check_inventory(hostvars, self.inventory.groups, self.faulted)

    def host_options(self, host: str) -> list[tuple[int, int]]:
        """Every (VE, PD) the planner's placement fits on `host` (only its own counts if pinned)."""
        variables = self.inventory.hostvars[host]
        if variables.get("epd_slices"):
            return [self.current.counts[host]]
        spec = read_host(
            host, {k: variables[k] for k in HOST_DEFAULTS if k in variables}, self.settings, self.faulted.get(host, ())
        )
        ve_max = 0 if self.text_only else spec.core_count // self.settings.ve_tp
        return [
            (ve, pd)
            for ve in range(ve_max + 1)
            for pd in range(spec.core_count // self.settings.pd_tp + 1)
            if place(replace(spec, num_ve=ve, num_pd=pd), self.settings, {"ve": ve, "pd": pd}) is not None
        ]

    def floor(self, role: str) -> int:
        """Engines of `role` that must stay in rotation: today's rollout floor (at least one
        engine for a pool that exists: a fleet serving images needs a VE, every fleet a PD)."""
        size = self.current.total(role)
        if size == 0:
            return 0
        try:
            floor = PoolRule.resolve(role, size, 1, self.min_available[role]).floor
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
                    PoolRule.resolve(role, size, self.batch[role], floor)
                except EpdPlanError as exc:
                    return str(exc)
        problems = self._check(self.hostvars_for(layout))["problems"]
        return "; ".join(problems) if problems else None

    def hostvars_for(self, layout: Layout) -> dict[str, dict[str, Any]]:
        hostvars = copy.deepcopy(self.inventory.hostvars)
        for host, (ve, pd) in layout.counts.items():
            hostvars[host]["epd_num_ve"], hostvars[host]["epd_num_pd"] = ve, pd
        return hostvars

    def plan_lines(self, layout: Layout) -> list[str]:
        checked = self._check(self.hostvars_for(layout))
        return plan_table(checked["plan"])

    def predict(self, analysis: Analysis, layout: Layout) -> Prediction:
        ve, pd = analysis.pools["ve"], analysis.pools["pd"]
        share = analysis.image_requests / pd.arrivals if pd.arrivals > 0 else 0.0
        return Prediction(
            ve.model.with_servers(layout.total("ve")),
            pd.model.with_servers(layout.total("pd") * pd.slots_per_engine),
            min(1.0, share),
        )

    def recommend(self, analysis: Analysis) -> Recommendation | None:
        """None when the window cannot support a recommendation (too little traffic)."""
        if not analysis.enough_traffic:
            return None
        before = self.predict(analysis, self.current)
        if analysis.bottleneck is None:
            return self._keep(analysis, before, analysis.verdict())
        options = {host: self.host_options(host) for host in self.engine_hosts}
        layout, prediction = self.current, before
        for _ in range(MAX_STEPS):
            step = self._best_step(analysis, layout, prediction, options)
            if step is None:
                break
            layout, prediction = step
        if layout == self.current:
            return self._keep(analysis, before, "no layout the planner accepts lowers the busiest pool's load enough")
        return Recommendation(self.current, layout, before, prediction, self.plan_lines(layout), analysis.verdict())

    def _keep(self, analysis: Analysis, before: Prediction, reason: str) -> Recommendation:
        return Recommendation(self.current, self.current, before, before, self.plan_lines(self.current), reason)

    def _best_step(
        self, analysis: Analysis, layout: Layout, now: Prediction, options: Mapping[str, list[tuple[int, int]]]
    ) -> tuple[Layout, Prediction] | None:
        candidates = []
        for host, choices in options.items():
            for choice in choices:
                if choice == layout.counts[host]:
                    continue
                trial = Layout({**layout.counts, host: choice})
                predicted = self.predict(analysis, trial)
                if predicted.busiest > now.busiest * (1 - MIN_GAIN):
                    continue
                if predicted.mean_s > now.mean_s * (1 + LATENCY_SLACK):
                    continue
                moved = sum(
                    abs(a - b)
                    for h in trial.counts
                    for a, b in zip(trial.counts[h], self.current.counts[h], strict=True)
                )
                candidates.append((predicted.busiest, predicted.mean_s, moved, host, choice, trial, predicted))
        for *_, trial, predicted in sorted(candidates, key=lambda c: c[:5]):
            if self.refusal(trial) is None:
                return trial, predicted
        return None
