"""Several models on one fleet (epd_models, plan/models.py): one placement of every model on the
hosts' cores, a model that does not fit refused naming it and the host, each further model's
ports and engine names, router.yaml's models, rollouts per model, and a one-model fleet exactly
as before."""

from __future__ import annotations

import copy

import pytest
import yaml

from epd_kit import plan as planner
from epd_kit.router_yaml import parse_config
from tests import repo_modules

VISION = "/models/tiny-qwen3-vl"
TEXT = {"name": "text", "model": "/models/tiny-text", "text_only": True, "num_pd": 1}


def check(models=None, **host):
    n1 = {"epd_model": VISION, "epd_num_ve": 1, "epd_num_pd": 1, "epd_core_count": 24, **host}
    if models is not None:
        n1["epd_models"] = models
    return planner.check_inventory(
        {"n1": n1}, {"epd_engines": ["n1"], "epd_router": ["n1"]}, None, repo_modules.filters().known_variables()
    )


def rows(result):
    return [
        (e["instance"], e["engine_id"], e["cores"][0], e["tp"], e["port"], e.get("model"))
        for e in result["plan"]["n1"]["engines"]
    ]


def test_two_models_share_the_host_each_on_its_own_cores_and_ports():
    result = check([TEXT])
    assert result["problems"] == []
    assert rows(result) == [
        ("pd-0", "epd-pd-0", 0, 8, 18100, None),
        ("ve-0", "epd-ve-0", 8, 4, 18300, None),
        ("text-pd-0", "epd-text-pd-0", 16, 8, 18164, "text"),
    ]
    text = next(e for e in result["plan"]["n1"]["engines"] if e.get("model") == "text")
    assert text["argv"][:3] == ["vllm", "serve", "/models/tiny-text"]


def test_adding_or_removing_a_further_model_moves_no_engine_of_the_others():
    """The first model's engines stay where it is placed alone (a moved engine restarts); a model
    added last takes the cores left; removing the last one moves nothing."""
    alone = {r[0]: r[2] for r in rows(check())}
    one = {r[0]: r[2] for r in rows(check([TEXT]))}
    second = {"name": "two", "model": "/m2", "text_only": True, "num_pd": 1, "pd_tp": 4}
    two = {r[0]: r[2] for r in rows(check([TEXT, second], epd_core_count=32))}
    assert alone == {"pd-0": 0, "ve-0": 8}
    assert one == {**alone, "text-pd-0": 16}
    assert two == {**one, "two-pd-0": 12}


def test_widest_tp_first_across_models_when_one_after_the_other_does_not_fit():
    """20 cores: model by model (the first's PD 0-7 and VE 8-11, then text's PD) leaves no aligned
    8-core block; widest TP first across models (both PDs, then the VE) fits, moving the VE."""
    result = check([TEXT], epd_core_count=20)
    assert result["problems"] == []
    assert [(r[0], r[2]) for r in rows(result)] == [("pd-0", 0), ("text-pd-0", 8), ("ve-0", 16)]


def test_a_model_that_does_not_fit_is_refused_naming_it_and_the_host():
    result = check([{**TEXT, "num_pd": 2}])
    assert result["plan"] is None
    assert result["problems"] == [
        "n1: model text does not fit: it asks for 0 VE (tp 4) + 2 PD (tp 8) = 16 cores beside "
        "/models/tiny-qwen3-vl (12 cores for epd_model's 1 VE + 1 PD), on 24 usable cores. Lower its "
        "num_ve/num_pd in epd_models, run it on other hosts (its hosts list), or give the host more cores. "
        "Each slice needs tp free cores starting at a multiple of tp."
    ]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({**TEXT, "name": "bad name"}, "epd_models[0].name 'bad name' must be letters, digits"),
        ({**TEXT, "num_ve": 1}, "epd_models[0] (text): text_only is true but num_ve is 1"),
        ({**TEXT, "text_only": False}, "epd_models[0] (text): no VE engine (num_ve 0)"),
        ({**TEXT, "pd_tp": 3}, "epd_models[0] (text): epd_pd_tp must be a power of two"),
        ({**TEXT, "hosts": ["n9"]}, "epd_models[0] (text).hosts names n9, which is not an engine host"),
        ({**TEXT, "colour": 1}, "epd_models[0]: unknown key(s) colour: remove it"),
        ({**TEXT, "model": "models/x"}, "epd_models[0] (text): epd_model 'models/x' looks like a relative path"),
        ({**TEXT, "pd_port_base": 18100}, "port 18100 is used by both epd-pd-0 (HTTP) and epd-text-pd-0 (HTTP)"),
    ],
)
def test_a_bad_model_entry_is_refused_naming_the_model(entry, message):
    result = check([entry])
    assert result["plan"] is None
    assert any(message in p for p in result["problems"]), result["problems"]


def test_two_entries_with_one_name_are_refused():
    result = check([TEXT, TEXT])
    assert any("epd_models[1] (text): the name 'text' is also epd_models[0]'s" in p for p in result["problems"])


def test_each_further_model_takes_the_next_port_block():
    second = {"name": "two", "model": "/m2", "text_only": True, "num_pd": 1, "pd_tp": 4}
    result = check([TEXT, second], epd_core_count=32)
    ports = {r[0]: r[4] for r in rows(result)}
    assert ports == {"pd-0": 18100, "text-pd-0": 18164, "two-pd-0": 18228, "ve-0": 18300}


def test_router_yaml_names_each_model_and_its_pools():
    result = check([TEXT])
    settings = planner.read_settings(result["settings"])
    config = planner.router_config(result["plan"], settings, listen_host="127.0.0.1", draining=["epd-text-pd-0"])
    assert [m["name"] for m in config["models"]] == [VISION, "text"]  # epd_model's is models[0]
    assert config["models"][1] == {
        "name": "text",
        "model": "/models/tiny-text",
        "quantization": None,
        "limits": {"images_per_prompt": 30, "max_image_patches": 1024},
        "endpoints": {
            "text_only": True,
            "ve": [],
            "pd": [{"id": "epd-text-pd-0", "url": "http://127.0.0.1:18164", "state": "draining"}],
        },
    }
    assert [e["id"] for e in config["models"][0]["endpoints"]["pd"]] == ["epd-pd-0"]
    parsed = parse_config(config)  # the router's own schema takes it
    assert parsed.lane_config("text").endpoints.text_only


def test_the_settings_round_trip_through_epd_fleet_settings():
    result = check([TEXT])
    again = planner.read_settings(result["settings"])
    assert again.as_dict()["epd_models"] == result["settings"]["epd_models"]
    assert [m.name for m in again.models] == ["text"]


def test_one_model_fleets_plan_and_render_exactly_as_before():
    without = check()
    empty = check([])
    assert without["plan"] == empty["plan"]
    [model] = planner.router_config(without["plan"], planner.read_settings(without["settings"]), listen_host="h")[
        "models"
    ]
    assert (model["name"], [e["id"] for e in model["endpoints"]["pd"]]) == (VISION, ["epd-pd-0"])
    assert all("model" not in e for e in without["plan"]["n1"]["engines"])


def test_rollouts_keep_each_models_floor():
    """Each model's PD pool is its own: one PD each, so each restarts alone (a pool of one), never
    counted as one pool of two whose floor another model's PD would keep."""
    result = check([TEXT])
    batches, rules = planner.rollout_batches(result["plan"])
    assert set(rules) == {"pd", "pd:text", "ve"}
    assert rules["pd:text"].size == 1 and rules["pd"].size == 1
    assert [[e["engine_id"] for e in b.engines] for b in batches] == [["epd-pd-0"], ["epd-text-pd-0"], ["epd-ve-0"]]
    lines = planner.rollout_plan(result["plan"])["lines"]
    assert (
        "PD of text: batches of up to 1, at least 0 of 1 stay in rotation"
        " (a pool of one leaves rotation while it restarts)" in lines
    )
    compiling, _ = planner.rollout_batches(result["plan"], compiles=True)
    assert compiling[0].canary and {e["engine_id"] for e in compiling[0].engines} == {
        "epd-pd-0",
        "epd-text-pd-0",
        "epd-ve-0",
    }


def test_retiring_engines_drain_in_their_own_models_pools():
    result = check([TEXT])
    pools = [
        {
            "id": "epd-pd-0",
            "url": "http://127.0.0.1:18100",
            "role": "pd",
            "state": "active",
            "model": "v",
            "model_index": 0,
        },
        {
            "id": "epd-pd-1",
            "url": "http://127.0.0.1:18101",
            "role": "pd",
            "state": "active",
            "model": "v",
            "model_index": 0,
        },
        {
            "id": "epd-text-pd-1",
            "url": "http://127.0.0.1:18165",
            "role": "pd",
            "state": "active",
            "model": "text",
            "model_index": 1,
        },
        {
            "id": "epd-gone-pd-0",
            "url": "http://127.0.0.1:18228",
            "role": "pd",
            "state": "active",
            "model": "gone",
            "model_index": 2,
        },
    ]
    out = planner.rollout.retiring_endpoints(result["plan"], copy.deepcopy(pools))
    assert out["retiring"] == ["epd-pd-1", "epd-text-pd-1"]
    settings = planner.read_settings(result["settings"])
    config = planner.router_config(result["plan"], settings, listen_host="h", retiring=out["engines"])
    first, text = config["models"]
    assert [e["id"] for e in first["endpoints"]["pd"]] == ["epd-pd-0", "epd-pd-1"]
    assert [(e["id"], e["state"]) for e in text["endpoints"]["pd"]] == [
        ("epd-text-pd-0", "active"),
        ("epd-text-pd-1", "draining"),
    ]


def test_the_advisor_sees_each_models_own_engines():
    """One advisor per model (docs/advisor.md "Several models"): the first model's counts per
    host, a further model's through its epd_models entry; a one-model fleet has one advisor."""
    from epd_kit.advise.layout import Advisor, Inventory

    n1 = {"epd_model": VISION, "epd_num_ve": 1, "epd_num_pd": 1, "epd_core_count": 24, "epd_models": [TEXT]}
    inventory = Inventory({"n1": n1}, {"epd_engines": ["n1"], "epd_router": ["n1"]})
    first, text = Advisor.per_model(inventory)
    assert (first.name, first.current.counts, first.current.entry) == (VISION, {"n1": (1, 1)}, None)
    assert (text.name, text.current.counts, text.current.entry) == ("text", {"n1": (0, 1)}, "epd_models[0] (text)")
    assert text.text_only and text.checkpoint == "/models/tiny-text"
    del n1["epd_models"]
    assert [a.current.counts for a in Advisor.per_model(inventory)] == [{"n1": (1, 1)}]


def test_the_advisor_keeps_each_models_own_rollout_floor():
    """The advisor's floor of a model's pool is the one its rollouts keep (rollout.resolve_pool,
    one place): an epd_models entry's own rollout_min_available_pd, not the fleet's."""
    from epd_kit.advise.layout import Advisor, Inventory, Layout

    text = {**TEXT, "num_pd": 3, "pd_tp": 4, "rollout_min_available_pd": 2}
    n1 = {"epd_model": VISION, "epd_num_ve": 1, "epd_num_pd": 1, "epd_core_count": 24, "epd_models": [text]}
    inventory = Inventory({"n1": n1}, {"epd_engines": ["n1"], "epd_router": ["n1"]})
    first, other = Advisor.per_model(inventory)
    assert (first.floor("pd"), other.floor("pd")) == (1, 2)
    assert other.rule("pd", 3).floor == 2 and other.rule("pd", 3).model == "text"
    assert other.refusal(Layout({"n1": (0, 1)}, other.current.entry)) == "a PD pool of 1 is below its floor of 2"


def running_file(models):
    """The router.yaml a host has, as the router play wrote it for `models` (parsed back)."""
    result = check(models)
    text = yaml.safe_dump(
        planner.router_config(result["plan"], planner.read_settings(result["settings"]), listen_host="127.0.0.1"),
        sort_keys=False,
    )
    return yaml.safe_load(text)


def test_a_draining_write_changes_the_endpoints_alone_a_new_model_waits_for_the_router_play():
    """A deploy that adds a model and a limit while it rolls the text model's engine: the
    rolling batch's write (running=) keeps the running `models` and limits (the router play's
    change: it rolls the processes) and drains the engine in its own pool; the new model's pools
    are not in it (the running router has no such model)."""
    running = running_file([TEXT])
    two = {"name": "two", "model": VISION, "text_only": True, "num_pd": 1, "pd_tp": 4}
    result = check([TEXT, two], epd_core_count=28)
    settings = planner.read_settings(result["settings"])
    kwargs = {
        "listen_host": "127.0.0.1",
        "draining": ["epd-text-pd-0"],
        "sections": {"limits": {"max_requests_preprocessing": 32}},
    }
    full = planner.router_config(result["plan"], settings, **kwargs)
    assert [m["name"] for m in full["models"]] == [VISION, "text", "two"]
    assert full["limits"]["max_requests_preprocessing"] == 32
    config = planner.router_config(result["plan"], settings, running=running, **kwargs)

    def without_endpoints(c):
        return {**c, "models": [{k: v for k, v in m.items() if k != "endpoints"} for m in c["models"]]}

    assert without_endpoints(config) == without_endpoints(running)
    assert list(config) == list(running)  # the file's order: a write that changes nothing changes no byte
    assert [m["name"] for m in config["models"]] == [VISION, "text"]
    assert config["models"][1]["endpoints"] == {
        "text_only": True,
        "ve": [],
        "pd": [{"id": "epd-text-pd-0", "url": "http://127.0.0.1:18164", "state": "draining"}],
    }
    assert config["models"][0]["endpoints"] == full["models"][0]["endpoints"]
    parse_config(config)  # the router's own schema (check-config) takes it


def test_a_draining_write_keeps_a_removed_models_pools_every_engine_draining():
    """A deploy without the text model: the running router still serves it (`models` is read at
    start), so the draining writes keep its pools with its engine draining, until the router play
    rolls the processes without it; the retire step waits on that engine in its own pool."""
    running = running_file([TEXT])
    result = check()
    settings = planner.read_settings(result["settings"])
    config = planner.router_config(result["plan"], settings, listen_host="127.0.0.1", running=running)
    assert [m["name"] for m in config["models"]] == [m["name"] for m in running["models"]] == [VISION, "text"]
    assert config["models"][1]["endpoints"] == {
        "text_only": True,
        "ve": [],
        "pd": [{"id": "epd-text-pd-0", "url": "http://127.0.0.1:18164", "state": "draining"}],
    }
    assert parse_config(config).lane_config("text").endpoints.pd[0].state.value == "draining"
    pools = [
        {"id": "epd-pd-0", "url": "http://127.0.0.1:18100", "role": "pd", "state": "active", "model_index": 0},
        {"id": "epd-text-pd-0", "url": "http://127.0.0.1:18164", "role": "pd", "state": "active", "model": "text"}
        | {"model_index": 1},
    ]
    served = [m["name"] for m in running["models"]]
    out = planner.rollout.retiring_endpoints(result["plan"], pools, served=served)
    assert out["retiring"] == ["epd-text-pd-0"]
    # the render drains the removed model's pools whole; the planned model's pools keep theirs
    drained = planner.router_config(
        result["plan"], settings, listen_host="127.0.0.1", running=running, retiring=out["engines"]
    )
    assert drained == config
    assert planner.rollout.retiring_endpoints(result["plan"], pools)["retiring"] == []  # not in the file: left


def test_without_a_running_file_the_draining_write_is_the_whole_render():
    result = check([TEXT])
    settings = planner.read_settings(result["settings"])
    full = planner.router_config(result["plan"], settings, listen_host="h")
    assert planner.router_config(result["plan"], settings, listen_host="h", running={}) == full


def test_a_models_own_rollout_floor_replaces_the_fleets_for_its_pools_alone():
    """The fleet's floor of 1 PD cannot hold for a one-PD text model: refused by the check with the
    rollout's own resolution; the model's own floor of 0 passes, and the rollout keeps the first
    model's floor of 1 (its 2 PDs restart one at a time) and lets the text PD leave rotation."""
    refused = check([TEXT], epd_num_pd=2, epd_rollout_min_available_pd=1, epd_core_count=32)
    assert refused["problems"] == [
        "model text: epd_rollout_min_available_pd: keeping 1 of the 1 PD engines in rotation leaves none to "
        "restart; lower it to at most 0 (the fleet's value, which every model's PD pool takes; or give this model "
        "its own: epd_models[0] (text).rollout_min_available_pd)"
    ]
    own = {**TEXT, "rollout_min_available_pd": 0}
    result = check([own], epd_num_pd=2, epd_rollout_min_available_pd=1, epd_core_count=32)
    assert result["problems"] == [], result["problems"]
    assert result["settings"]["epd_models"][0]["rollout_min_available_pd"] == 0
    _, rules = planner.rollout_batches(result["plan"], min_available={"pd": 1}, models=result["settings"]["epd_models"])
    assert (rules["pd"].size, rules["pd"].floor) == (2, 1)
    assert (rules["pd:text"].size, rules["pd:text"].floor) == (1, 0)
    lines = planner.rollout_plan(result["plan"], min_available={"pd": 1}, models=result["settings"]["epd_models"])
    assert "PD: batches of up to 1, at least 1 of 2 stay in rotation" in lines["lines"]
