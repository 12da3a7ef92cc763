"""Batched rollouts (docs/operations.md "Rolling restart"): which engines restart together.

A rollout restarts the selected engines batch by batch. Each batch holds engines of one pool
only (VE or PD), at most the pool's batch size, and never so many that fewer than the pool's
floor stay in rotation. Engines of a pool are taken round-robin over the hosts, so a batch
spreads over hosts (they restart in parallel) and no host empties first.

A deploy against a running fleet rolls only the engines whose effective configuration changed
(`changed_engines`) and drains engines it removes before they stop (`retiring_endpoints`).

Cache-aware (docs/operations.md "Compile cache"): a rollout that may change what the engines
compile (`compile=True`: a deploy's changed engines) first restarts one canary per distinct
engine configuration (`compile_config`), so a configuration that fails to compile stops the
rollout before any other batch, and its artifacts reach the shared tier before the rest start,
which then fetch instead of compiling. The canaries of different pools restart together (a VE
and a PD configuration compile at the same time, not one after the other); within a pool they
keep its batch size and floor.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .errors import EpdPlanError
from .operations import rolling_queue
from .unit import read_env_file
from .variables import VARIABLES

POOLS = ("pd", "ve")
# How an engine starts, not what runs: the stagger and the readiness budget (env file) and the
# start timeout (unit) follow the stagger and the compile budget; changing them restarts nothing.
START_GATE_VARIABLES = frozenset({"EPD_START_DELAY_S", "EPD_READY_TIMEOUT_S"})
START_GATE_UNIT_KEYS = ("TimeoutStartSec=",)
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$")


def amount(value: Any, pool_size: int, variable: str, *, round_up: bool) -> int:
    """A count, or a percentage string of the pool ("25%"): rounded up for a floor, down for a batch."""
    if isinstance(value, bool):
        raise EpdPlanError(f"{variable}: {value!r} is neither a count nor a percentage like '25%'")
    text = str(value).strip()
    percent = _PERCENT.match(text)
    if percent:
        share = float(percent.group(1))
        if share > 100:
            raise EpdPlanError(f"{variable}: {text} is more than the whole pool")
        exact = pool_size * share / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    if not text.isdigit():
        raise EpdPlanError(f"{variable}: {value!r} is neither a count nor a percentage like '25%'")
    return int(text)


@dataclass(frozen=True)
class PoolRule:
    """One pool's rollout limits, resolved to counts."""

    pool: str
    size: int  # engines of the pool in the whole plan, selected or not
    batch: int
    floor: int  # engines that stay in rotation during every batch
    model: str | None = None  # its model's key (models.fleet_models): an epd_models name; None: models[0]

    @classmethod
    def resolve(
        cls, pool: str, size: int, batch: Any, min_available: Any, names: tuple[str, str] | None = None
    ) -> PoolRule:
        """names: the (batch, floor) settings as the inventory wrote them (default: the fleet's variables)."""
        batch_variable, floor_variable = names or (f"epd_rollout_batch_{pool}", f"epd_rollout_min_available_{pool}")
        count = amount(batch, size, batch_variable, round_up=False)
        if count == 0 and not _PERCENT.match(str(batch)):
            raise EpdPlanError(f"{batch_variable}: a batch holds at least 1 engine")
        count = max(1, count)  # a small percentage of a small pool still restarts one at a time
        # unset: one engine stays in; a pool of one can only restart by leaving rotation
        floor = (
            min(1, size - 1)
            if min_available in (None, "")
            else amount(min_available, size, floor_variable, round_up=True)
        )
        if size - floor < 1:
            raise EpdPlanError(
                f"{floor_variable}: keeping {floor} of the {size} {pool.upper()} engines in rotation leaves none "
                f"to restart; lower it to at most {size - 1}"
            )
        if count > size:
            raise EpdPlanError(
                f"{batch_variable}: {count} is more than the {size} {pool.upper()} engines planned; "
                f"set it to at most {size - floor}"
            )
        if count > size - floor:
            raise EpdPlanError(
                f"{batch_variable}: a batch of {count} {pool.upper()} engines leaves {size - count} of {size} in "
                f"rotation, below {floor_variable} {floor}; set it to at most {size - floor}"
            )
        return cls(pool, size, count, floor)


@dataclass(frozen=True)
class Batch:
    """Engines that leave rotation, restart and come back together."""

    pool: str  # "pd" or "ve"; a canary batch holding both pools' canaries: "pd+ve"
    engines: tuple[Mapping[str, str], ...]  # {host, instance, engine_id} each
    canary: bool = False  # the first engine of its configuration in a compiling rollout

    def as_dict(self) -> dict[str, Any]:
        hosts: dict[str, list[str]] = {}
        for engine in self.engines:
            hosts.setdefault(engine["host"], []).append(engine["instance"])
        return {
            "pool": self.pool,
            "canary": self.canary,
            "engines": [dict(engine) for engine in self.engines],
            "engine_ids": [engine["engine_id"] for engine in self.engines],
            "hosts": [{"host": host, "instances": instances} for host, instances in hosts.items()],
        }


def _round_robin(engines: Sequence[Mapping[str, str]]) -> list[Mapping[str, str]]:
    """The engines in turns over their hosts: the first of each host, then the second, ..."""
    by_host: dict[str, list[Mapping[str, str]]] = {}
    for engine in engines:
        by_host.setdefault(engine["host"], []).append(engine)
    turns = max((len(queue) for queue in by_host.values()), default=0)
    return [queue[turn] for turn in range(turns) for queue in by_host.values() if turn < len(queue)]


def _selected(
    plan: Mapping[str, Mapping[str, Any]], engines: str | Mapping[str, Sequence[str]] | None
) -> list[dict[str, str]]:
    """rolling_queue's selection by name, or exactly the instances of a {host: [instance]} mapping
    (an empty mapping selects nothing: a deploy with nothing to roll)."""
    if engines is None or isinstance(engines, str):
        return rolling_queue(plan, engines)
    wanted = {(host, instance) for host, instances in engines.items() for instance in instances}
    planned = {(host, e["instance"]) for host, host_plan in plan.items() for e in host_plan["engines"]}
    unknown = sorted(wanted - planned)
    if unknown:
        raise EpdPlanError(f"not planned: {', '.join(f'{i} on {h}' for h, i in unknown)}")
    return [
        {"host": host, "instance": e["instance"], "engine_id": e["engine_id"]}
        for host, host_plan in plan.items()
        for e in host_plan["engines"]
        if (host, e["instance"]) in wanted
    ]


# per-instance values that do not reach the compiled graphs (listen address, port, NIXL engine
# id and side channel, the core slice: the plugin normalises device indices, compilation_cache.md
# "Cache Key")
_INSTANCE_VARIABLES = frozenset({"EPD_HOST", "EPD_PORT", "EPD_EC_TRANSFER_CONFIG"})
_INSTANCE_ENV = frozenset({"NEURON_VISIBLE_DEVICES"})


def compile_config(engine: Mapping[str, Any]) -> str:
    """A short name of what the engine compiles: its role, TP and every command and environment
    value except the per-instance ones. Engines with equal names share their cache keys."""
    shaping = {
        "role": engine["role"],
        "tp": engine["tp"],
        "command": {k: v for k, v in engine["unit_variables"].items() if k not in _INSTANCE_VARIABLES},
        "env": {k: v for k, v in engine["env"].items() if k not in _INSTANCE_ENV},
    }
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:8]
    return f"{engine['role']}-tp{engine['tp']}-{digest}"


def precompile_jobs(
    plan: Mapping[str, Mapping[str, Any]],
    cache_environment: Mapping[str, str],
    target: str,
    executable: str,
    root: str,
    user: str,
    timeout_s: int,
) -> list[dict[str, Any]]:
    """One CPU compile per distinct engine configuration of the plan (playbooks/precompile.yml):
    the first engine of that configuration's exact argv (argv[0] = executable) and environment,
    plus the unit's cache and loader variables (PATH, LD_LIBRARY_PATH), in CPU compile mode for
    `target` (cpu_compilation.md: VLLM_NEURON_CPU_COMPILE=1 needs NEURON_PLATFORM_TARGET_OVERRIDE),
    each with its own VLLM_CACHE_ROOT under `root` so its keys stay apart. Strict-mode variables
    are dropped (this run must compile); --host becomes 127.0.0.1 (not in the cache key, and
    another machine's). Each job runs as a transient systemd service (`run_argv`), since no
    source says the server exits after a CPU compile: the play stops it."""
    strict = {"NEURON_LIBTORCH_DISABLE_GRAPH_CAPTURE_BACKEND", "VLLM_NEURON_DISABLE_WARMUP_COMPILE"}
    jobs: dict[str, dict[str, Any]] = {}
    for host, host_plan in plan.items():
        for engine in host_plan["engines"]:
            config = compile_config(engine)
            if config in jobs:
                continue
            argv = [executable, *engine["argv"][1:]]
            if "--host" in argv[:-1]:
                argv[argv.index("--host") + 1] = "127.0.0.1"
            if "--port" not in argv[:-1]:
                raise EpdPlanError(f"{engine['engine_id']}: its command has no --port (precompile waits on /health)")
            port = int(argv[argv.index("--port") + 1])
            cache_root = f"{root}/{config}"
            env = {
                **engine["env"],
                **{k: v for k, v in cache_environment.items() if k not in strict},
                "VLLM_CACHE_ROOT": cache_root,
                "VLLM_NEURON_CPU_COMPILE": "1",
                "NEURON_PLATFORM_TARGET_OVERRIDE": target,
            }
            assignments = [f"{k}={v}" for k, v in sorted(env.items())]
            unit = f"epd-precompile-{config}.service"
            jobs[config] = {
                "config": config,
                "engine_id": engine["engine_id"],
                "host": host,
                "cache_root": cache_root,
                "local_dir": f"{cache_root}/neuron/compile_cache",
                "argv": argv,
                "env": assignments,
                "unit": unit,
                "health_url": f"http://127.0.0.1:{port}/health",
                "port": port,
                "run_argv": _transient_unit(unit, config, engine["engine_id"], user, cache_root, timeout_s)
                + [f"--setenv={a}" for a in assignments]
                + ["--", *(a.replace("$", "$$") for a in argv)],
            }
    return list(jobs.values())


def _transient_unit(unit: str, config: str, engine_id: str, user: str, cwd: str, timeout_s: int) -> list[str]:
    """systemd-run up to its `--`: the engine user, a clean environment (only --setenv), the
    journal for the output, and the compile budget as RuntimeMaxSec, so the server stops even
    when the play does not. RemainAfterExit keeps an exit's status readable until the play stops
    the unit. Type=exec: a missing executable fails systemd-run itself."""
    return [
        "systemd-run",
        f"--unit={unit}",
        f"--description=epd-kit precompile {config} (as {engine_id})",
        f"--uid={user}",
        f"--gid={user}",
        "--remain-after-exit",
        "--property=Type=exec",
        f"--property=WorkingDirectory={cwd}",
        f"--property=RuntimeMaxSec={int(timeout_s)}",
        f"--property=SyslogIdentifier={unit.removesuffix('.service')}",
    ]


def rollout_batches(
    plan: Mapping[str, Mapping[str, Any]],
    engines: str | Mapping[str, Sequence[str]] | None = None,
    batch: Mapping[str, Any] | None = None,
    min_available: Mapping[str, Any] | None = None,
    compiles: bool = False,
    models: Sequence[Mapping[str, Any]] = (),
) -> tuple[list[Batch], dict[str, PoolRule]]:
    """The batches restarting the selected engines (all when none is named), PD pool first, and the
    resolved rule of each pool that has a selected engine. batch / min_available: per pool ("ve",
    "pd"), a count or a percentage; a setting that cannot keep the pool's floor is refused.
    engines: a selection by name (comma-separated instances or ids) or a {host: [instance]} mapping.
    compiles: the rollout may change the compiled graphs, so one canary per distinct configuration
    restarts first, before any other batch; the pools' canaries restart together, up to each
    pool's batch size per canary batch. models: the epd_models entries (as
    epd_fleet_settings holds them): an entry's rollout_batch_<pool> / rollout_min_available_<pool>
    replace the fleet's for that model's pools."""
    by_key = {(host, e["instance"]): e for host, host_plan in plan.items() for e in host_plan["engines"]}
    # each model's pools are their own: its own size, batches and floor; models[0]'s keep their
    # keys ("pd", "ve": the naming rule of models.py), an epd_models entry's are "pd:<name>", "ve:<name>"
    model_names = list(dict.fromkeys(e.get("model") for e in by_key.values()))
    selected = _selected(plan, engines)
    canaries: dict[str, list[Mapping[str, str]]] = {}  # per pool, its canaries in order
    batches: list[Batch] = []
    rules: dict[str, PoolRule] = {}
    for pool in POOLS:
        for model in model_names:
            key = pool if model is None else f"{pool}:{model}"
            size_of = sum(1 for e in by_key.values() if e["role"] == pool and e.get("model") == model)
            members = [
                e
                for e in selected
                if by_key[(e["host"], e["instance"])]["role"] == pool
                and by_key[(e["host"], e["instance"])].get("model") == model
            ]
            if not members:
                continue
            rules[key] = rule = resolve_pool(pool, model, size_of, batch, min_available, models)
            ordered = _round_robin(members)
            if compiles:
                first: dict[str, Mapping[str, str]] = {}
                for e in ordered:
                    first.setdefault(compile_config(by_key[(e["host"], e["instance"])]), e)
                canaries[key] = list(first.values())
                ordered = [e for e in ordered if e not in first.values()]
            batches += [Batch(pool, chunk) for chunk in _chunks(ordered, rule.batch)]
    return _canary_batches(canaries, rules) + batches, rules


def pool_sizes(plan: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, str | None], int]:
    """{(pool, model): its engines in the plan} (model None: the first), pools in POOLS order."""
    sizes: dict[tuple[str, str | None], int] = {}
    models = list(dict.fromkeys(e.get("model") for host_plan in plan.values() for e in host_plan["engines"]))
    for pool in POOLS:
        for model in models:
            engines = (e for host_plan in plan.values() for e in host_plan["engines"])
            count = sum(1 for e in engines if (e["role"], e.get("model")) == (pool, model))
            if count:
                sizes[(pool, model)] = count
    return sizes


def resolve_pool(
    pool: str,
    model: str | None,
    size: int,
    batch: Mapping[str, Any] | None,
    min_available: Mapping[str, Any] | None,
    models: Sequence[Mapping[str, Any]] = (),
) -> PoolRule:
    """One model's pool's rule, as every rollout and the inventory check (validate.rollout_problems) resolve it."""
    count, floor, names = _pool_settings(pool, model, batch, min_available, models)
    try:
        rule = PoolRule.resolve(pool, size, count, floor, names)
    except EpdPlanError as error:
        raise EpdPlanError(_model_error(model, str(error), names, pool, models)) from None
    return rule if model is None else replace(rule, model=model)


def _pool_settings(
    pool: str,
    model: str | None,
    batch: Mapping[str, Any] | None,
    min_available: Mapping[str, Any] | None,
    models: Sequence[Mapping[str, Any]],
) -> tuple[Any, Any, tuple[str, str]]:
    """(batch, floor, their names as written) of one model's pool: the fleet's variables, or the
    model entry's own keys where it sets them (epd_models[i].rollout_batch_pd, ...)."""
    size = (batch or {}).get(pool, VARIABLES[f"epd_rollout_batch_{pool}"].default)
    floor = (min_available or {}).get(pool)
    names = (f"epd_rollout_batch_{pool}", f"epd_rollout_min_available_{pool}")
    for index, entry in enumerate(models if model is not None else ()):
        if entry.get("name") != model:
            continue
        where = f"epd_models[{index}] ({model})"
        if entry.get(f"rollout_batch_{pool}") not in (None, ""):
            size, names = entry[f"rollout_batch_{pool}"], (f"{where}.rollout_batch_{pool}", names[1])
        if entry.get(f"rollout_min_available_{pool}") not in (None, ""):
            floor, names = entry[f"rollout_min_available_{pool}"], (names[0], f"{where}.rollout_min_available_{pool}")
    return size, floor, names


def _model_error(
    model: str | None, error: str, names: tuple[str, str], pool: str, models: Sequence[Mapping[str, Any]]
) -> str:
    """An epd_models entry's pool refused under the fleet's value: say so, and which key sets its own."""
    if model is None:
        return error
    index = next((i for i, entry in enumerate(models) if entry.get("name") == model), None)
    fleet_names = {f"epd_rollout_batch_{pool}": "batch", f"epd_rollout_min_available_{pool}": "min_available"}
    own = [f"rollout_{fleet_names[n]}_{pool}" for n in names if n in fleet_names and error.startswith(n)]
    if index is None or not own:
        return f"model {model}: {error}"
    return (
        f"model {model}: {error} (the fleet's value, which every model's {pool.upper()} pool takes; or give this "
        f"model its own: epd_models[{index}] ({model}).{own[0]})"
    )


def _chunks(engines: Sequence[Mapping[str, str]], size: int) -> list[tuple[Mapping[str, str], ...]]:
    """The engines in order, `size` at a time (the last chunk may be shorter)."""
    return [tuple(engines[i : i + size]) for i in range(0, len(engines), size)]


def _canary_batches(canaries: Mapping[str, Sequence[Mapping[str, str]]], rules: Mapping[str, PoolRule]) -> list[Batch]:
    """The canaries in as few batches as the pools' rules allow: batch k holds each pool's k-th
    slice of up to its batch size. Different pools compile at the same time; a pool never has
    more engines out than its own batches would take."""
    slices = {key: _chunks(engines, rules[key].batch) for key, engines in canaries.items()}
    rounds = max((len(s) for s in slices.values()), default=0)
    out = []
    for k in range(rounds):
        keys = [key for key in slices if k < len(slices[key])]
        label = "+".join(dict.fromkeys(key.split(":", 1)[0] for key in keys))
        out.append(Batch(label, tuple(e for key in keys for e in slices[key][k]), canary=True))
    return out


@dataclass(frozen=True)
class StartTimes:
    """What one engine start is expected to take, per way it gets its graphs (operator estimates,
    epd_rollout_expected_*_s; no source gives these for a model: docs/operations.md "Compile cache")."""

    compile_s: int = VARIABLES["epd_rollout_expected_compile_s"].default  # a cache miss: neuronx-cc compiles
    fetch_s: int = VARIABLES["epd_rollout_expected_fetch_s"].default  # a local miss the shared tier answers
    warm_s: int = VARIABLES["epd_rollout_expected_warm_s"].default  # a local hit: load weights and NEFFs, warm up

    def of(self, outcome: str) -> int:
        return {"compiles": self.compile_s, "fetches": self.fetch_s}.get(outcome, self.warm_s)


def engine_outcomes(
    batches: Sequence[Batch],
    plan: Mapping[str, Mapping[str, Any]],
    *,
    compiles: bool,
    shared: bool,
    strict: bool,
) -> list[list[str]]:
    """Per batch and engine: "compiles", "fetches" (from the shared tier) or "local hit".

    Without a graph change every engine hits its host's local cache. With one, a canary compiles
    (strict mode: it must fetch, precompile.yml put the keys there); the rest fetch from the shared
    tier, or without one hit the local cache of a host whose canary compiled their configuration,
    or compile."""
    by_key = {(host, e["instance"]): e for host, host_plan in plan.items() for e in host_plan["engines"]}
    compiled_on: set[tuple[str, str]] = set()
    out: list[list[str]] = []
    for item in batches:
        row = []
        for e in item.engines:
            config = compile_config(by_key[(e["host"], e["instance"])])
            if not compiles or (e["host"], config) in compiled_on:
                outcome = "local hit"
            elif strict or (shared and not item.canary):
                outcome = "fetches"
            else:
                outcome = "compiles"
            compiled_on.add((e["host"], config))
            row.append(outcome)
        out.append(row)
    return out


def recorded_starts(plan: Mapping[str, Mapping[str, Any]], shows: Mapping[str, str]) -> dict[str, int]:
    """The last start of each engine configuration, as systemd recorded it: per host the output of
    `systemctl show -p Id -p InactiveExitTimestampMonotonic -p ActiveEnterTimestampMonotonic` for its
    engine units; per configuration the longest start (stagger, load, compile, /health) of its
    running engines, in whole seconds. Engines not started since boot are left out."""
    by_unit = {
        (host, f"epd-engine@{e['instance']}.service"): compile_config(e)
        for host, host_plan in plan.items()
        for e in host_plan["engines"]
    }
    out: dict[str, int] = {}
    for host, text in shows.items():
        for block in text.strip().split("\n\n"):
            fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
            config = by_unit.get((host, fields.get("Id", "")))
            began, ready = (
                fields.get("InactiveExitTimestampMonotonic", ""),
                fields.get("ActiveEnterTimestampMonotonic", ""),
            )
            if config is None or not began.isdigit() or not ready.isdigit() or int(ready) <= int(began):
                continue
            out[config] = max(out.get(config, 0), round((int(ready) - int(began)) / 1e6))
    return out


def rollout_estimate_s(batches: Sequence[Batch], plan: Mapping[str, Mapping[str, Any]], drain_timeout_s: int) -> int:
    """The rollout's upper bound: per batch, the drain timeout plus the longest start timeout of its hosts."""
    return sum(
        drain_timeout_s + max(int(plan[e["host"]]["start_timeout_s"]) for e in batch.engines) for batch in batches
    )


def _minutes(seconds: int) -> str:
    return f"{seconds} s (~{math.ceil(seconds / 60)} min)"


def rollout_plan(
    plan: Mapping[str, Mapping[str, Any]],
    engines: str | Mapping[str, Sequence[str]] | None = None,
    batch: Mapping[str, Any] | None = None,
    min_available: Mapping[str, Any] | None = None,
    drain_timeout_s: int = VARIABLES["epd_rr_drain_timeout_s"].default,
    compiles: bool = False,
    shared: bool = False,
    strict: bool = False,
    expected: Mapping[str, Any] | None = None,
    systemd_shows: Mapping[str, str] | None = None,
    models: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The rollout's input: {batches, lines}, lines being the plan it prints before starting.
    compiles / shared / strict: the rollout may change the graphs, the shared tier is set, the
    engines are cache-hit-only; expected: StartTimes overrides (compile_s, fetch_s, warm_s);
    systemd_shows: per engine host, `systemctl show` of its engine units (recorded_starts): this
    fleet's last start per configuration replaces the expected time of a local hit of that
    configuration (a restart takes about what the last one took). models: as rollout_batches."""
    batches, rules = rollout_batches(plan, engines, batch, min_available, compiles=compiles, models=models)
    times = StartTimes(**{k: int(v) for k, v in (expected or {}).items() if v not in (None, "")})
    outcomes = engine_outcomes(batches, plan, compiles=compiles, shared=shared, strict=strict)
    count = sum(len(b.engines) for b in batches)
    lines = [f"{count} engines in {len(batches)} batches"]
    canaries = sum(len(b.engines) for b in batches if b.canary)
    if canaries:
        lines.append(
            f"canaries first: {canaries} (one per engine configuration; the pools' canaries together):"
            " a failed start stops the rollout"
            + (" before any other batch; their graphs reach the shared tier before the rest start" if shared else "")
        )
    for rule in rules.values():
        alone = " (a pool of one leaves rotation while it restarts)" if rule.size == 1 else ""
        kept = f"at least {rule.floor} of {rule.size} stay in rotation"
        name = f"{rule.pool.upper()} of {rule.model}" if rule.model else rule.pool.upper()
        lines.append(f"{name}: batches of up to {rule.batch}, {kept}{alone}")
    for number, (item, row) in enumerate(zip(batches, outcomes, strict=True), 1):
        members = ", ".join(f"{e['engine_id']} ({e['host']}, {o})" for e, o in zip(item.engines, row, strict=True))
        kind = " canary" if item.canary else ""
        lines.append(f"batch {number}/{len(batches)} {item.pool.upper()}{kind}: {members}")
    tally = {o: sum(row.count(o) for row in outcomes) for o in ("compiles", "fetches", "local hit")}
    recorded = recorded_starts(plan, systemd_shows or {})
    by_key = {(host, e["instance"]): e for host, host_plan in plan.items() for e in host_plan["engines"]}

    def start_s(engine: Mapping[str, str], outcome: str) -> int:
        config = compile_config(by_key[(engine["host"], engine["instance"])])
        return recorded[config] if outcome == "local hit" and config in recorded else times.of(outcome)

    expected_s = sum(
        max(start_s(e, o) for e, o in zip(item.engines, row, strict=True))
        for item, row in zip(batches, outcomes, strict=True)
    )
    for config, seconds in sorted(recorded.items()):
        lines.append(f"last start of {config} (this fleet, systemd): {seconds} s")
    bound = rollout_estimate_s(batches, plan, drain_timeout_s)
    lines.append(
        f"estimate: ~{_minutes(expected_s)} plus draining: {tally['compiles']} compile (~{times.compile_s} s each), "
        f"{tally['fetches']} fetch (~{times.fetch_s} s), {tally['local hit']} local hit (~{times.warm_s} s), "
        f"the slowest start of each batch; worst case {_minutes(bound)} = per batch the drain timeout "
        f"{drain_timeout_s} s plus its hosts' start timeout (TimeoutStartSec)"
    )
    return {"batches": [b.as_dict() for b in batches], "lines": lines, "expected_s": expected_s, "bound_s": bound}


def _effective_env(assignments: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in assignments.items() if name not in START_GATE_VARIABLES}


def _effective_unit(text: str) -> list[str]:
    """The unit's lines that shape the running engine (comments and the start timeout dropped)."""
    lines = (line.strip() for line in text.splitlines())
    return [
        line for line in lines if line and not line.startswith(("#", ";")) and not line.startswith(START_GATE_UNIT_KEYS)
    ]


def changed_engines(
    env_files: Mapping[str, Mapping[str, str]],
    deployed_env_files: Mapping[str, str],
    unit: str,
    deployed_unit: str | None,
) -> list[str]:
    """The instances whose effective command, environment or unit differ from what is deployed.

    env_files: the env file each planned instance gets now ({instance: {name: value}});
    deployed_env_files: the text of the env files on the host (instances without one are new, so
    not a change); unit / deployed_unit: the engine unit's text now and on the host (None: none yet).
    The stagger, the readiness budget and the start timeout are not part of the comparison.
    """
    unit_changed = deployed_unit is not None and _effective_unit(unit) != _effective_unit(deployed_unit)
    return [
        instance
        for instance, env in env_files.items()
        if instance in deployed_env_files
        and (unit_changed or _effective_env(env) != _effective_env(read_env_file(deployed_env_files[instance])))
    ]


def retiring_endpoints(
    plan: Mapping[str, Mapping[str, Any]],
    pools: Sequence[Mapping[str, Any]],
    *,
    served: Sequence[str] = (),
) -> dict[str, Any]:
    """The engines a router serves that the plan no longer has, to drain before they stop.

    pools: the engines of the router's GET /pools ({id, url, role, state}; with several models
    also `model`, the served name, and `model_index`, its position in `models`). served: the
    names of the models the host's router.yaml lists (its `models`). Returns {retiring: [id],
    engines: [those engines]}: router_config's `retiring` adds each, draining, to its model's
    pools, so its requests finish before it stops. An engine of a listed model the plan no longer
    has is retiring too: the endpoints-only render (router_config's `running`) keeps that model's
    pools, every engine draining. An engine of a model neither planned nor listed is left alone.
    """
    planned = {e["engine_id"] for p in plan.values() for e in p["engines"]}
    names = {e["model"] for p in plan.values() for e in p["engines"] if "model" in e}

    def listed(engine: Mapping[str, Any]) -> bool:  # model_index 0: the one listed first, always planned
        return not engine.get("model_index") or engine.get("model") in names or engine.get("model") in served

    retiring = [e for e in pools if e["id"] not in planned and e.get("state") != "removed" and listed(e)]
    return {"retiring": [e["id"] for e in retiring], "engines": [dict(e) for e in retiring]}
