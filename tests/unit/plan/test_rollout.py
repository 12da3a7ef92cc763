"""Batched rollouts: the batches rolling_restart.yml restarts together, their floors, the printed plan."""

import itertools

import pytest

from epd_kit import plan

MODEL = "/models/Qwen3-VL-32B-Instruct"


def fleet(shape: dict[str, tuple[int, int]]) -> dict:
    """A plan of hosts named by (VE count, PD count); TP 4 so eight engines fit on a host."""
    settings = plan.read_settings({"epd_model": MODEL, "epd_pd_tp_size": 4})
    hosts = [
        plan.read_host(name, {"epd_num_ve": ve, "epd_num_pd": pd, "epd_bind_address": f"10.0.0.{i}"}, settings)
        for i, (name, (ve, pd)) in enumerate(shape.items(), 1)
    ]
    return plan.plan_fleet(settings, hosts)


def ids(batches):
    return [[e["engine_id"] for e in b.engines] for b in batches]


THREE = fleet({"a": (1, 2), "b": (1, 2), "c": (0, 1)})


def test_defaults_restart_one_engine_at_a_time_pd_pool_first():
    batches, rules = plan.rollout_batches(THREE)
    assert ids(batches) == [
        ["epd-a-pd-0"],
        ["epd-b-pd-0"],
        ["epd-c-pd-0"],
        ["epd-a-pd-1"],
        ["epd-b-pd-1"],
        ["epd-a-ve-0"],
        ["epd-b-ve-0"],
    ]
    assert rules["pd"] == plan.rollout.PoolRule("pd", size=5, batch=1, floor=1)


def test_a_batch_spreads_over_hosts_and_never_mixes_pools():
    batches, _ = plan.rollout_batches(THREE, batch={"pd": 3, "ve": "50%"})
    assert ids(batches) == [
        ["epd-a-pd-0", "epd-b-pd-0", "epd-c-pd-0"],
        ["epd-a-pd-1", "epd-b-pd-1"],
        ["epd-a-ve-0"],
        ["epd-b-ve-0"],
    ]
    assert batches[1].as_dict()["hosts"] == [{"host": "a", "instances": ["pd-1"]}, {"host": "b", "instances": ["pd-1"]}]


def test_percentages_round_batches_down_and_floors_up():
    _, rules = plan.rollout_batches(THREE, batch={"pd": "50%"}, min_available={"pd": "30%"})
    assert (rules["pd"].batch, rules["pd"].floor) == (2, 2)  # 2.5 -> 2 restart, 1.5 -> 2 stay
    _, rules = plan.rollout_batches(THREE, batch={"pd": "10%"})
    assert rules["pd"].batch == 1  # a batch holds at least one engine


@pytest.mark.parametrize(
    ("batch", "min_available", "message"),
    [
        (
            {"pd": 5},
            {},
            "epd_rollout_batch_pd: a batch of 5 PD engines leaves 0 of 5 in rotation, below "
            "epd_rollout_min_available_pd 1; set it to at most 4",
        ),
        ({"pd": "80%"}, {"pd": 2}, "epd_rollout_batch_pd: a batch of 4 PD engines .* set it to at most 3"),
        ({"pd": 0}, {}, "epd_rollout_batch_pd: a batch holds at least 1 engine"),
        ({"pd": 6}, {}, "epd_rollout_batch_pd: 6 is more than the 5 PD engines planned; set it to at most 4"),
        ({}, {"ve": "100%"}, "epd_rollout_min_available_ve: keeping 2 of the 2 VE engines in rotation leaves none"),
        ({"ve": "two"}, {}, "epd_rollout_batch_ve: 'two' is neither a count nor a percentage"),
        ({"ve": "150%"}, {}, "epd_rollout_batch_ve: 150% is more than the whole pool"),
    ],
)
def test_a_setting_that_breaks_the_floor_is_refused(batch, min_available, message):
    with pytest.raises(plan.EpdPlanError, match=message):
        plan.rollout_batches(THREE, batch=batch, min_available=min_available)


def test_a_pool_of_one_restarts_out_of_rotation_unless_a_floor_forbids_it():
    one = fleet({"solo": (1, 1)})
    assert ids(plan.rollout_batches(one)[0]) == [["epd-pd-0"], ["epd-ve-0"]]
    assert "a pool of one leaves rotation" in " ".join(plan.rollout_plan(one)["lines"])
    with pytest.raises(plan.EpdPlanError, match="keeping 1 of the 1 VE"):
        plan.rollout_batches(one, min_available={"ve": 1})


def test_a_selection_rolls_only_the_named_engines_and_refuses_unknown_ones():
    batches, rules = plan.rollout_batches(THREE, "pd-1,epd-c-pd-0", batch={"pd": 2})
    assert ids(batches) == [["epd-a-pd-1", "epd-b-pd-1"], ["epd-c-pd-0"]]
    assert list(rules) == ["pd"]
    with pytest.raises(plan.EpdPlanError, match="unknown engines pd-9"):
        plan.rollout_batches(THREE, "pd-9")


def test_the_printed_plan_lists_batches_and_bounds_the_duration_by_the_start_timeouts():
    rollout = plan.rollout_plan(THREE, batch={"pd": 3}, drain_timeout_s=60)
    start = THREE["a"]["start_timeout_s"]
    assert rollout["lines"][:4] == [
        "7 engines in 4 batches",
        "PD: batches of up to 3, at least 1 of 5 stay in rotation",
        "VE: batches of up to 1, at least 1 of 2 stay in rotation",
        "batch 1/4 PD: epd-a-pd-0 (a, local hit), epd-b-pd-0 (b, local hit), epd-c-pd-0 (c, local hit)",
    ]
    assert f"worst case {4 * (60 + start)} s" in rollout["lines"][-1]
    assert "start timeout (TimeoutStartSec)" in rollout["lines"][-1]
    # nothing changed: every engine hits its local cache, 4 batches x the warm start
    assert rollout["expected_s"] == 4 * plan.rollout.StartTimes().warm_s
    assert "0 compile" in rollout["lines"][-1] and "7 local hit" in rollout["lines"][-1]
    assert rollout["batches"][0]["engine_ids"] == ["epd-a-pd-0", "epd-b-pd-0", "epd-c-pd-0"]


SHAPES = [{"a": (1, 1)}, {"a": (2, 3)}, {"a": (1, 4), "b": (2, 0), "c": (0, 3)}, {"a": (3, 2), "b": (3, 2)}]
AMOUNTS = [1, 2, 3, 7, "0", "25%", "50%", "99%", "100%"]
FLOORS = ["", 0, 1, 2, "10%", "50%", "90%"]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_engine_restarts_exactly_once_and_no_batch_breaks_a_floor(shape):
    """Property over a grid of fleets and settings: a plan is either refused or sound."""
    fleet_plan = fleet(shape)
    engines = [(host, e["instance"]) for host, p in fleet_plan.items() for e in p["engines"]]
    role = {(host, e["instance"]): e["role"] for host, p in fleet_plan.items() for e in p["engines"]}
    planned = refused = 0
    for batch, floor in itertools.product(AMOUNTS, FLOORS):
        settings = {"batch": {"ve": batch, "pd": batch}, "min_available": {"ve": floor, "pd": floor}}
        try:
            batches, rules = plan.rollout_batches(fleet_plan, **settings)
        except plan.EpdPlanError:
            refused += 1
            continue
        planned += 1
        restarted = [(e["host"], e["instance"]) for b in batches for e in b.engines]
        assert sorted(restarted) == sorted(engines)
        for item in batches:
            rule = rules[item.pool]
            assert {role[(e["host"], e["instance"])] for e in item.engines} == {item.pool}
            assert 1 <= len(item.engines) <= rule.batch
            assert rule.size - len(item.engines) >= rule.floor
            if floor == "" and rule.size > 1:  # the default keeps one engine of the pool in
                assert rule.size - len(item.engines) >= 1
    assert planned and refused


def test_a_compiling_rollout_starts_one_canary_per_configuration_first_the_pools_together():
    batches, _ = plan.rollout_batches(THREE, batch={"pd": 2}, compiles=True)
    assert [b.canary for b in batches] == [True, False, False, False]
    assert batches[0].pool == "pd+ve"  # a VE and a PD configuration compile at the same time
    assert ids(batches) == [
        ["epd-a-pd-0", "epd-a-ve-0"],
        ["epd-b-pd-0", "epd-c-pd-0"],
        ["epd-a-pd-1", "epd-b-pd-1"],
        ["epd-b-ve-0"],
    ]
    configs = {plan.rollout.compile_config(e) for p in THREE.values() for e in p["engines"]}
    assert len(configs) == 2  # the core slice, port and engine id are not part of it


def test_a_different_configuration_gets_its_own_canary():
    two = fleet({"a": (1, 2), "b": (1, 2)})
    two["b"]["engines"][0]["env"] = {**two["b"]["engines"][0]["env"], "NEURON_CC_FLAGS": "--optlevel=1"}
    batches, rules = plan.rollout_batches(two, compiles=True)
    canaries = [b for b in batches if b.canary]
    assert sum(len(b.engines) for b in canaries) == 3
    # PD batches of one: the two PD configurations' canaries never leave rotation together
    assert [b.pool for b in canaries] == ["pd+ve", "pd"]
    for item in canaries:
        for pool, rule in rules.items():
            out = sum(1 for e in item.engines if e["instance"].startswith(pool))
            assert out <= rule.batch and rule.size - out >= rule.floor


@pytest.mark.parametrize(
    ("shared", "strict", "expected_rest"),
    [(True, False, "fetches"), (False, False, "compiles"), (True, True, "fetches")],
)
def test_the_plan_says_who_compiles_and_who_fetches(shared, strict, expected_rest):
    rollout = plan.rollout_plan(
        THREE,
        compiles=True,
        shared=shared,
        strict=strict,
        expected={"compile_s": 1000, "fetch_s": 100, "warm_s": 10},
    )
    lines = rollout["lines"]
    canary = [line for line in lines if " canary: " in line]
    assert len(canary) == 1 and "PD+VE canary" in canary[0]  # both configurations at once
    first = "fetches" if strict else "compiles"
    assert f"epd-a-pd-0 (a, {first})" in canary[0] and f"epd-a-ve-0 (a, {first})" in canary[0]
    rest = [line for line in lines if line.startswith("batch ") and " canary: " not in line]
    # epd-b-pd-0 is the first on host b: it fetches or compiles; a's second PD hits a's local cache
    assert expected_rest in rest[0]
    assert "epd-a-pd-1 (a, local hit)" in " ".join(rest)
    per_batch = {"compiles": 1000, "fetches": 100, "local hit": 10}
    first_start = 100 if strict else 1000
    # rest: b-pd-0, c-pd-0 (first of their host), a-pd-1, b-pd-1 (local hit), b-ve-0
    assert rollout["expected_s"] == first_start + 3 * per_batch[expected_rest] + 2 * per_batch["local hit"]
    assert rollout["expected_s"] < rollout["bound_s"]


def test_precompile_runs_each_configuration_once_in_cpu_compile_mode_with_the_fleets_command():
    cache_env = {"HOME": "/var/cache/epd", "VLLM_CACHE_ROOT": "/c", "VLLM_NEURON_DISABLE_WARMUP_COMPILE": "1"}
    jobs = plan.rollout.precompile_jobs(THREE, cache_env, "trn2", "/opt/epd/venv/bin/epd-sim", "/p", "epd", 7200)
    assert sorted(j["engine_id"] for j in jobs) == ["epd-a-pd-0", "epd-a-ve-0"]  # one per configuration
    for job in jobs:
        engine = next(e for e in THREE[job["host"]]["engines"] if e["engine_id"] == job["engine_id"])
        host = engine["argv"].index("--host")
        assert job["argv"][0] == "/opt/epd/venv/bin/epd-sim"
        assert job["argv"][host + 1] == "127.0.0.1"
        assert job["argv"][1:host] + job["argv"][host + 2 :] == engine["argv"][1:host] + engine["argv"][host + 2 :]
        env = dict(item.split("=", 1) for item in job["env"])
        assert env["VLLM_NEURON_CPU_COMPILE"] == "1" and env["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn2"
        assert env["VLLM_CACHE_ROOT"] == f"/p/{job['config']}" and job["local_dir"].endswith("/neuron/compile_cache")
        assert "VLLM_NEURON_DISABLE_WARMUP_COMPILE" not in env  # a precompile must compile
        assert env["NEURON_VISIBLE_DEVICES"] == engine["env"]["NEURON_VISIBLE_DEVICES"]


def test_each_precompile_job_is_a_transient_unit_with_the_jobs_user_environment_and_argv():
    # no source says vllm serve exits after a CPU compile: the play runs it as a service it can stop
    cache_env = {"HOME": "/var/cache/epd", "VLLM_CACHE_ROOT": "/c", "NEURON_LIBTORCH_REMOTE_CACHE": "/mnt/fsx/c"}
    loader = {"PATH": "/opt/engine/bin:/usr/bin", "LD_LIBRARY_PATH": "/opt/amazon/efa/lib64"}
    jobs = plan.rollout.precompile_jobs(THREE, cache_env | loader, "trn2", "/opt/engine/bin/vllm", "/p", "epd", 5400)
    for job in jobs:
        run = job["run_argv"]
        cut = run.index("--")
        head, command = run[:cut], run[cut + 1 :]
        assert head[0] == "systemd-run" and f"--unit={job['unit']}" in head
        assert job["unit"] == f"epd-precompile-{job['config']}.service"
        assert {"--uid=epd", "--gid=epd", "--remain-after-exit", "--property=RuntimeMaxSec=5400"} <= set(head)
        assert f"--property=WorkingDirectory={job['cache_root']}" in head
        assert command == job["argv"]  # the same argv as the foreground job had
        setenv = [a.removeprefix("--setenv=") for a in head if a.startswith("--setenv=")]
        assert setenv == job["env"]  # the same environment, and nothing else
        env = dict(item.split("=", 1) for item in setenv)
        assert env["PATH"] == loader["PATH"] and env["LD_LIBRARY_PATH"] == loader["LD_LIBRARY_PATH"]
        assert env["NEURON_LIBTORCH_REMOTE_CACHE"] == "/mnt/fsx/c"  # the sources disagree where keys land
        port = job["argv"][job["argv"].index("--port") + 1]
        assert job["health_url"] == f"http://127.0.0.1:{port}/health" and job["port"] == int(port)
    assert len({job["unit"] for job in jobs}) == len(jobs)


def test_a_dollar_in_the_engines_argv_reaches_it_literally_through_systemd():
    engine = dict(THREE["a"]["engines"][0])
    engine["argv"] = [*engine["argv"], "--served-model-name", "m$HOME${X}"]
    one = {"a": {**THREE["a"], "engines": [engine]}}
    (job,) = plan.rollout.precompile_jobs(one, {}, "trn2", "/x/vllm", "/p", "epd", 60)
    assert job["run_argv"][-1] == "m$$HOME$${X}"  # systemd expands $VAR in ExecStart; $$ is a literal $
    assert job["argv"][-1] == "m$HOME${X}"


def test_the_estimate_uses_this_fleets_last_start_per_configuration():
    def unit(instance: str, began: int, ready: int) -> str:
        return "\n".join(
            [f"Id=epd-engine@{instance}.service", f"InactiveExitTimestampMonotonic={began}"]
            + [f"ActiveEnterTimestampMonotonic={ready}"]
        )

    shows = {
        "a": "\n\n".join(
            [unit("pd-0", 10_000_000, 85_000_000), unit("pd-1", 10_000_000, 50_000_000), unit("ve-0", 0, 0)]
        )
    }
    recorded = plan.rollout.recorded_starts(THREE, shows)
    pd_config = plan.rollout.compile_config(THREE["a"]["engines"][0])
    assert recorded == {pd_config: 75}  # the longest PD start; the VE never started since boot
    rollout = plan.rollout_plan(THREE, systemd_shows=shows, expected={"warm_s": 10})
    assert f"last start of {pd_config} (this fleet, systemd): 75 s" in rollout["lines"]
    assert rollout["expected_s"] == 5 * 75 + 2 * 10  # 5 PD batches at the recorded start, 2 VE at the default
